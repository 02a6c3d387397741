// A test agent: the openai Node SDK on Node's built-in fetch, default host (api.openai.com).
const path = require('path');
const OpenAI = require(path.join(process.env.LCAP_TEST_NODE_MODULES, 'openai'));

async function main() {
  const client = new OpenAI({ maxRetries: 0, timeout: 30000 });
  const r = await client.chat.completions.create({ model: 'gpt-4o-mini', messages: [{ role: 'user', content: 'Say hello' }] });
  console.log('node chat:', r.choices[0].message.content);
  const stream = await client.chat.completions.create({ model: 'gpt-4o-mini', stream: true, messages: [{ role: 'user', content: 'Say hello' }] });
  let text = '';
  for await (const chunk of stream) text += chunk.choices[0]?.delta?.content || '';
  console.log('node stream:', text);
}
main().catch((err) => { console.error('node agent failed:', err.message, err.cause && err.cause.message); process.exit(1); });
