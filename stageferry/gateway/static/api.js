// The console's access to the gateway: the bearer token, JSON calls, and the server-sent event reader.
// SSE is read with fetch() rather than EventSource because EventSource cannot send an Authorization header.
"use strict";

const Api = (() => {
  const TOKEN_KEY = "stageferry.token";
  let onUnauthorized = () => {};

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  function setToken(value) {
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
  }

  function headers(extra, sent) {
    const h = Object.assign({}, extra || {});
    const t = sent === undefined ? token() : sent;
    if (t) h["Authorization"] = "Bearer " + t;
    return h;
  }

  // A 401 asks for a token only while the token it refused is still the one set: the reply to a call sent
  // before a token was saved (the page's first calls go out without one) must not reopen the dialog.
  function refused(reply, sent) {
    if (reply.status === 401 && sent === token()) onUnauthorized();
  }

  class ApiError extends Error {
    constructor(status, body) {
      const err = (body && body.error) || {};
      super(err.message || "HTTP " + status);
      this.status = status;
      this.code = err.code || "http_" + status;
      this.param = err.param || null;
      this.fieldErrors = Array.isArray(err.field_errors) ? err.field_errors : [];
    }
  }

  async function request(method, path, body) {
    const sent = token();
    const reply = await fetch(path, { method, body, headers: headers({}, sent), cache: "no-store" });
    refused(reply, sent);
    if (!reply.ok) {
      let parsed = null;
      try { parsed = await reply.json(); } catch (_) { /* not JSON */ }
      throw new ApiError(reply.status, parsed);
    }
    return reply;
  }

  async function json(path) {
    return (await request("GET", path)).json();
  }

  async function post(path, formData) {
    return (await request("POST", path, formData)).json();
  }

  async function blob(path) {
    return (await request("GET", path)).blob();
  }

  // Calls onFrame(frame) for every `data:` message of the stream; resolves when the stream ends.
  async function follow(path, onFrame, signal) {
    const sent = token();
    const reply = await fetch(path, { headers: headers({ Accept: "text/event-stream" }, sent), signal, cache: "no-store" });
    refused(reply, sent);
    if (!reply.ok) {
      let parsed = null;
      try { parsed = await reply.json(); } catch (_) { /* not JSON */ }
      throw new ApiError(reply.status, parsed);
    }
    const reader = reply.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffered.indexOf("\n\n")) >= 0) {
        const message = buffered.slice(0, cut);
        buffered = buffered.slice(cut + 2);
        let event = "message";
        const data = [];
        for (const line of message.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
        }
        if (data.length) {
          try { onFrame(event, JSON.parse(data.join("\n"))); } catch (e) { console.warn("bad frame", e); }
        }
      }
    }
  }

  return {
    token, setToken, headers, json, post, blob, follow, ApiError,
    set onUnauthorized(fn) { onUnauthorized = fn; },
  };
})();
