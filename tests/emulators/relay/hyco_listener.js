// Microsoft's hyco-https listener, unchanged, against the Relay emulator.
// Usage: node hyco_listener.js <listenUri> <token>   (NODE_PATH must include tools/node/node_modules)
// Answers every request with JSON describing what it received; `?size=N` asks for an N-byte body instead.
'use strict';
const crypto = require('crypto');
const https = require('hyco-https');

const [listenUri, token] = process.argv.slice(2);
if (!listenUri || !token) {
  console.error('usage: node hyco_listener.js <listenUri> <token>');
  process.exit(2);
}

const server = https.createRelayedServer({ server: listenUri, token: token }, (req, res) => {
  const chunks = [];
  req.on('data', (chunk) => chunks.push(Buffer.from(chunk)));
  req.on('end', () => {
    const body = Buffer.concat(chunks);
    const size = new URL(req.url, 'http://listener').searchParams.get('size');
    res.setHeader('X-Handled-By', 'hyco-https');
    if (size) {
      res.setHeader('Content-Type', 'application/octet-stream');
      res.end(Buffer.alloc(parseInt(size, 10), 'z'));
      return;
    }
    res.setHeader('Content-Type', 'application/json');
    res.statusCode = req.method === 'POST' ? 202 : 200;
    res.end(JSON.stringify({
      method: req.method,
      url: req.url,
      headers: req.headers,
      bodyLength: body.length,
      bodySha256: crypto.createHash('sha256').update(body).digest('hex'),
    }));
  });
});

server.on('listening', () => console.log('listening'));
server.on('error', (error) => console.error('hyco-https error: ' + (error.message || error)));
server.listen();
process.on('SIGTERM', () => { server.close(); process.exit(0); });
