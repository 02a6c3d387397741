"""A calculator agent (openai SDK, chat completions with tools), as a user would write it for a small model.

    python calculator.py --question "What is 61 * 65?"

The model gets a `calculator` tool and, since a small model has never been taught a tool format, two worked
examples in its history (question, tool call, tool result, answer), as agent authors write few-shot prompts.
The harness runs each tool call and sends the result back; the model's first plain-text reply is the agent's
answer, printed. It calls https://api.openai.com with OPENAI_API_KEY and knows nothing of lcap.
"""

import argparse
import ast
import json
import operator
import os

from openai import OpenAI

SYSTEM = (
    "You are a helpful assistant. Use the calculator tool for arithmetic, then give the result as: Answer: <number>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression and return its value.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12*34"}},
                "required": ["expression"],
            },
        },
    }
]
EXAMPLES = ((23, 47), (81, 16))  # the worked examples' questions: the task set never asks them
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The tool: + - * / over numbers and parentheses, or an error the model reads."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers and + - * / ( )")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def worked_example(a: int, b: int, n: int) -> list[dict]:
    call = {"id": f"example_{n}", "type": "function", "function": {"name": "calculator", "arguments": ""}}
    call["function"]["arguments"] = json.dumps({"expression": f"{a} * {b}"})
    return [
        {"role": "user", "content": f"What is {a} * {b}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": calculate(f"{a} * {b}")},
        {"role": "assistant", "content": f"Answer: {a * b}"},
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--question", required=True)
    ap.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"))
    ap.add_argument("--turns", type=int, default=3, help="calls to the model at most")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()

    client = OpenAI()
    messages = [{"role": "system", "content": SYSTEM}]
    for n, (a, b) in enumerate(EXAMPLES):
        messages += worked_example(a, b, n)
    messages.append({"role": "user", "content": args.question})
    print(tool_loop(client, messages, args))


def tool_loop(client: OpenAI, messages: list[dict], args: argparse.Namespace) -> str:
    """Ask the model (--turns calls at most), running each calculator call it makes: its last reply's text."""
    answer = ""
    for _ in range(args.turns):
        response = client.chat.completions.create(
            model=args.model, messages=messages, tools=TOOLS, max_tokens=args.max_tokens, temperature=args.temperature
        )
        message = response.choices[0].message
        answer = message.content or ""
        if not message.tool_calls:
            break
        messages.append(message.model_dump(include={"role", "content", "tool_calls"}))
        for call in message.tool_calls:
            try:
                expression = str(json.loads(call.function.arguments).get("expression", ""))
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            result = (
                calculate(expression) if call.function.name == "calculator" else f"error: no tool {call.function.name}"
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return answer


if __name__ == "__main__":
    main()
