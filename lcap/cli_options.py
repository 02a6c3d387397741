"""What every stage's commands share: `--db`, one-line errors, `--label` parsing, and options dataclasses as flags.

A stage's options live in one dataclass (`TrainOptions`, `BuildOptions`, ...): each field's default and
help are written there once, with `option()`. `with_options` turns those fields into typer flags on a
command and hands the command one instance, so the CLI and the Python API can never disagree.
This module imports no stage: each stage's `commands.py` imports it, and `lcap.cli` imports them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from lcap.config import LcapError, default_db

DbOption = Annotated[Path, typer.Option("--db", help="DuckDB store (env LCAP_DB).", default_factory=default_db)]

F = TypeVar("F", bound=Callable[..., Any])


def one_line_errors(func: F) -> F:
    """Turn an LcapError into one line on stderr and exit code 2: no traceback for user mistakes."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except LcapError as exc:
            typer.echo(f"lcap: {exc}", err=True)
            raise typer.Exit(2) from None

    return typing.cast(F, wrapper)


def parse_labels(items: Iterable[str] | None) -> dict[str, str]:
    """`--label key=value` items as a dict; a malformed one is a one-line error."""
    labels = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise LcapError(f"bad --label {item!r}: use key=value")
        labels[key] = value
    return labels


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flag: str | None = None,
    cli: bool = True,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that is also a command-line flag: `flag` (default `--field-name`) with `help`.

    `cli=False` keeps a field out of the command line (set by code only). A bool field's flag is written as
    `--x/--no-x` where both spellings make sense, or as one switch (`--full`)."""
    metadata = {"help": help, "flag": flag, "cli": cli}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def cli_fields(cls: type, exclude: Iterable[str] = ()) -> list[dataclasses.Field]:
    skip = set(exclude)
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", False) and f.name not in skip]


def with_options(cls: type, param: str, *, exclude: Iterable[str] = ()) -> Callable[[F], F]:
    """Add `cls`'s fields to a typer command as flags and pass the command one `cls` instance as `param`.

    Decorators stack: a command can take several options dataclasses (e.g. the loop's collect, build and
    train options); `exclude` leaves fields out where a command fixes them itself."""
    fields = cli_fields(cls, exclude)
    hints = typing.get_type_hints(cls, include_extras=True)
    tuples = {f.name for f in fields if typing.get_origin(hints[f.name]) is tuple}

    def decorate(func: F) -> F:
        signature = inspect.signature(func)
        # real types, also under `from __future__ import annotations`
        own = typing.get_type_hints(func, include_extras=True)
        kept = [
            p.replace(annotation=own.get(p.name, p.annotation))
            for p in signature.parameters.values()
            if p.name != param
        ]
        taken = {p.name for p in kept}
        clash = taken & {f.name for f in fields}
        if clash:
            raise TypeError(f"{func.__name__}: options {sorted(clash)} of {cls.__name__} clash with its own parameters")
        added = [
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=_default(f),
                annotation=Annotated[
                    _cli_type(hints[f.name]), typer.Option(*_flags(f, hints[f.name]), help=f.metadata["help"])
                ],
            )
            for f in fields
        ]
        ordered = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in kept] + added

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {f.name: kwargs.pop(f.name) for f in fields if f.name in kwargs}
            values = {k: tuple(v) if isinstance(v, list) and k in tuples else v for k, v in values.items()}
            kwargs[param] = cls(**values)
            return func(*args, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=ordered, return_annotation=inspect.Signature.empty)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in ordered}
        return typing.cast(F, wrapper)

    return decorate


def _flags(f: dataclasses.Field, hint: Any) -> tuple[str, ...]:
    name = "--" + f.name.replace("_", "-")
    flag = f.metadata.get("flag") or (f"{name}/--no-{name[2:]}" if hint is bool else name)
    return tuple(part.strip() for part in flag.split(",")) if "," in flag else (flag,)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return ...


def _cli_type(hint: Any) -> Any:
    """The type typer parses a field as: Literal choices are strings (the dataclass checks them), tuples lists."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return str
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        inner = _cli_type(args[0]) if len(args) == 1 else hint
        return inner | None if type(None) in typing.get_args(hint) else inner
    if origin is tuple:
        return types.GenericAlias(list, typing.get_args(hint)[0])  # list[T], built at run time
    return hint
