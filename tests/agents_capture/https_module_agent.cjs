// A test agent on Node's http/https modules, no fetch: what node-fetch, axios and older SDKs build on.
// Call 1 goes to api.openai.com (through lcap); call 2 goes to LOCAL_LLM_URL, which NO_PROXY names (direct);
// call 3 goes to api.openai.com with the client's own keep-alive agent, as openai Node SDK v4 does (through lcap).
const http = require('http');
const https = require('https');

function post(mod, url, body, agent) {
  return new Promise((resolve, reject) => {
    const headers = { 'content-type': 'application/json', authorization: `Bearer ${process.env.OPENAI_API_KEY}` };
    const req = mod.request(url, { method: 'POST', headers, ...(agent ? { agent } : {}) }, (res) => {
      let data = '';
      res.on('data', (chunk) => { data += chunk; });
      res.on('end', () => resolve(JSON.parse(data)));
    });
    req.on('error', reject);
    req.end(JSON.stringify(body));
  });
}

async function main() {
  const body = { model: 'gpt-4o-mini', messages: [{ role: 'user', content: 'Say hello' }] };
  const viaProxy = await post(https, 'https://api.openai.com/v1/chat/completions', body);
  console.log('https module:', viaProxy.choices[0].message.content);
  const direct = await post(http, `${process.env.LOCAL_LLM_URL}/v1/chat/completions`, body);
  console.log('no_proxy:', direct.choices[0].message.content);
  const ownAgent = await post(https, 'https://api.openai.com/v1/chat/completions', body, new https.Agent({ keepAlive: true }));
  console.log('own agent:', ownAgent.choices[0].message.content);
}
main().catch((err) => { console.error('node agent failed:', err.message); process.exit(1); });
