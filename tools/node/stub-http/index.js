module.exports = require("node:http");
