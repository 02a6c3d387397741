// lcap's Node preload (NODE_OPTIONS=--require): Node's built-in fetch ignores HTTP(S)_PROXY, so
// make undici's EnvHttpProxyAgent the global dispatcher. It reads HTTPS_PROXY / HTTP_PROXY /
// NO_PROXY; the CA comes from NODE_EXTRA_CA_CERTS, which lcap also sets. Never breaks the child.
'use strict';
try {
  const path = require('path');
  const modules = process.env.LCAP_NODE_MODULES;
  if (modules && (process.env.HTTPS_PROXY || process.env.HTTP_PROXY || process.env.https_proxy)) {
    const undici = require(path.join(modules, 'undici'));
    const emitWarning = process.emitWarning;
    process.emitWarning = function (warning, ...rest) {  // undici flags EnvHttpProxyAgent experimental
      const code = rest.find((r) => typeof r === 'string' && r.startsWith('UNDICI-')) || (rest[0] && rest[0].code);
      if (code === 'UNDICI-EHPA') return;
      return emitWarning.call(this, warning, ...rest);
    };
    undici.setGlobalDispatcher(new undici.EnvHttpProxyAgent());
  }
} catch (err) {
  if (process.env.LCAP_DEBUG) {
    process.stderr.write(`lcap preload: ${err && err.message}\n`);
  }
}
