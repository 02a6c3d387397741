// lcap's Node preload (NODE_OPTIONS=--require). Node 20 ignores HTTP(S)_PROXY everywhere, so:
// - fetch (undici): undici's EnvHttpProxyAgent becomes the global dispatcher;
// - the http/https modules (node-fetch, axios without its own proxy set-up, raw https.request):
//   their global agents go through the proxy unless NO_PROXY names the host, and so do requests
//   that bring their own plain agent (openai Node SDK v4's keep-alive agent).
// The CA comes from NODE_EXTRA_CA_CERTS, which lcap also sets. Never breaks the child.
'use strict';

function routeFetch(modules) {
  const undici = require(modules + '/undici');
  const emitWarning = process.emitWarning;
  process.emitWarning = function (warning, ...rest) {  // undici flags EnvHttpProxyAgent experimental
    const code = rest.find((r) => typeof r === 'string' && r.startsWith('UNDICI-')) || (rest[0] && rest[0].code);
    if (code === 'UNDICI-EHPA') return;
    return emitWarning.call(this, warning, ...rest);
  };
  undici.setGlobalDispatcher(new undici.EnvHttpProxyAgent());
}

function bypassed(host, noProxy) {
  const name = String(host || '').toLowerCase().replace(/^\[|\]$/g, '');
  return noProxy.some((entry) => entry === '*' || name === entry || name.endsWith('.' + entry));
}

function routeHttpModules(modules, env) {
  const http = require('http');
  const https = require('https');
  const { Agent } = require(modules + '/agent-base');
  const { HttpsProxyAgent } = require(modules + '/https-proxy-agent');
  const { HttpProxyAgent } = require(modules + '/http-proxy-agent');
  const httpsProxy = env.HTTPS_PROXY || env.https_proxy || env.HTTP_PROXY || env.http_proxy;
  const httpProxy = env.HTTP_PROXY || env.http_proxy || httpsProxy;
  const noProxy = (env.NO_PROXY || env.no_proxy || '').split(',')
    .map((e) => e.trim().toLowerCase().replace(/^\*?\./, '').replace(/:\d+$/, '')).filter(Boolean);
  const direct = { http: new http.Agent({ keepAlive: true }), https: new https.Agent({ keepAlive: true }) };
  const proxied = { http: new HttpProxyAgent(httpProxy, { keepAlive: true }),
                    https: new HttpsProxyAgent(httpsProxy, { keepAlive: true }) };

  class LcapAgent extends Agent {
    connect(req, opts) {
      const scheme = opts.secureEndpoint ? 'https' : 'http';
      return bypassed(opts.host, noProxy) ? direct[scheme] : proxied[scheme];
    }
  }

  const agent = new LcapAgent({ keepAlive: true });
  http.globalAgent = agent;
  https.globalAgent = agent;
  for (const mod of [http, https]) {
    for (const name of ['request', 'get']) {
      mod[name] = withLcapAgent(mod[name], agent, Agent, http.Agent);
    }
  }
}

// A request's own plain agent (not a proxy agent: those are agent-base Agents) would connect
// directly: the request takes lcap's agent instead, which keeps connections alive too. What the
// own agent set beyond pooling (its TLS options) is not carried over.
function withLcapAgent(request, agent, ProxyAgent, PlainAgent) {
  return function (...args) {
    const i = args.findIndex((a) => a && typeof a === 'object' && !(a instanceof URL));
    const own = i >= 0 ? args[i].agent : undefined;
    if (own instanceof PlainAgent && !(own instanceof ProxyAgent)) {
      args[i] = { ...args[i], agent };
    }
    return request.apply(this, args);
  };
}

try {
  const modules = process.env.LCAP_NODE_MODULES;
  if (modules && (process.env.HTTPS_PROXY || process.env.HTTP_PROXY || process.env.https_proxy)) {
    routeFetch(modules);
    routeHttpModules(modules, process.env);
  }
} catch (err) {
  if (process.env.LCAP_DEBUG) {
    process.stderr.write(`lcap preload: ${err && err.message}\n`);
  }
}
