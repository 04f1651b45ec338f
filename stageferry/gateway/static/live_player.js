// Playing a video while it is being written: GET /v1/videos/{id}/content on a running request answers the
// growing fragmented MP4 (header `X-Live: 1`, chunked, no Content-Length; gateway/live.py) or 409 not_ready
// while there is nothing to stream yet.  LivePlayer.play() reads that body with fetch() + a stream reader
// and appends it to a MediaSource SourceBuffer as it arrives; the codec string is read from the MP4's own
// header (the avcC box: profile, compatibility, level; mp4a when there is audio), so it always matches what
// the decode stage wrote.  Where MediaSource or that type is unsupported, or the deployment does not stream,
// it says so (reason) and the console loads the whole file when the job is done, as before.
// window.stageferryLive exposes what happened (mode, codec, appended bytes, appends, reason) for tests.
"use strict";

const LivePlayer = (() => {
  const RETRY_MS = 500;       // 409 not_ready: ask again after this long ...
  const MAX_RETRIES = 40;     // ... at most this many times (20 s), then wait for the whole file

  const ascii = (bytes, at) => String.fromCharCode(bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]);
  const hex2 = (n) => n.toString(16).padStart(2, "0");

  function concat(parts) {
    const total = parts.reduce((n, p) => n + p.length, 0);
    const out = new Uint8Array(total);
    let at = 0;
    for (const p of parts) { out.set(p, at); at += p.length; }
    return out;
  }

  // The length of the init segment (ftyp … moov) at the start of `bytes`, or 0 while moov is incomplete.
  function initLength(bytes) {
    let at = 0;
    while (at + 8 <= bytes.length) {
      const size = ((bytes[at] << 24) >>> 0) + (bytes[at + 1] << 16) + (bytes[at + 2] << 8) + bytes[at + 3];
      if (size < 8) return -1;  // 64-bit or to-end boxes do not occur before moov in a fragmented MP4
      if (ascii(bytes, at + 4) === "moov") return at + size <= bytes.length ? at + size : 0;
      at += size;
    }
    return 0;
  }

  function find(bytes, name, from, to) {
    for (let i = from; i + 4 <= to; i++) if (ascii(bytes, i) === name) return i;
    return -1;
  }

  // The MediaSource type of an init segment: 'video/mp4; codecs="avc1.PPCCLL[, mp4a.40.2]"', or null.
  function mimeType(init) {
    const avcc = find(init, "avcC", 0, init.length);
    if (avcc < 0 || avcc + 8 > init.length) return null;
    const codecs = ["avc1." + hex2(init[avcc + 5]) + hex2(init[avcc + 6]) + hex2(init[avcc + 7])];
    const esds = find(init, "esds", 0, init.length);
    if (find(init, "mp4a", 0, init.length) >= 0) {
      // AudioSpecificConfig's object type (the first 5 bits after the DecoderSpecificInfo tag 0x05), AAC-LC = 2
      let object = 2;
      const tag = esds >= 0 ? init.indexOf(0x05, esds + 12) : -1;
      if (tag > 0) {
        let at = tag + 1;
        while (at < init.length && init[at] & 0x80) at++;  // the descriptor's variable-length size
        if (at + 1 < init.length) object = init[at + 1] >> 3;
      }
      codecs.push("mp4a.40." + object);
    }
    return `video/mp4; codecs="${codecs.join(", ")}"`;
  }

  function updated(buffer) {
    return new Promise((resolve, reject) => {
      buffer.addEventListener("updateend", resolve, { once: true });
      buffer.addEventListener("error", () => reject(new Error("SourceBuffer error")), { once: true });
    });
  }

  async function append(buffer, bytes, state) {
    buffer.appendBuffer(bytes);
    await updated(buffer);
    state.appendedBytes += bytes.length;
    state.appends += 1;
  }

  // Fetch the content while the job runs: the live reply, or null (not streaming: state.reason says why).
  async function open(path, state, signal, isRunning) {
    for (let attempt = 0; ; attempt++) {
      const reply = await fetch(path, { headers: Api.headers(), signal, cache: "no-store" });
      if (reply.ok && reply.headers.get("X-Live") === "1") return reply;
      if (reply.ok) { reply.body.cancel(); state.reason = "finished before it was streamed"; return null; }
      let code = "http_" + reply.status;
      try { code = (await reply.json()).error.code || code; } catch (_) { /* not JSON */ }
      if (reply.status !== 409 || code !== "not_ready") { state.reason = "refused: " + code; return null; }
      if (attempt >= MAX_RETRIES) { state.reason = `not streamed (${code} ${attempt + 1} times)`; return null; }
      if (!isRunning()) { state.reason = "ended before it was streamed"; return null; }
      await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
    }
  }

  // Stream the running video `id` into `player`.  Resolves with {blob} (the whole MP4, for the download
  // link) when the stream ended and every byte was appended, or null when it did not stream (state.reason).
  async function play(id, player, { signal, isRunning, onStart }) {
    const state = { id, mode: "pending", codec: null, appendedBytes: 0, appends: 0, reason: null, ended: false };
    window.stageferryLive = state;
    const done = (reason) => { state.mode = "whole"; state.reason = reason; console.info("live player:", reason); return null; };
    if (!window.MediaSource) return done("MediaSource is not available in this browser");
    const reply = await open(`/v1/videos/${encodeURIComponent(id)}/content`, state, signal, isRunning);
    if (!reply) return done(state.reason);
    const reader = reply.body.getReader();
    const parts = [];
    let head = new Uint8Array(0);
    let cut = 0;
    while (cut === 0) {  // the header first: it names the codecs
      const { value, done: eof } = await reader.read();
      if (eof) return done("the stream ended before the MP4 header");
      parts.push(value);
      head = concat(parts);
      cut = initLength(head);
    }
    const type = cut > 0 ? mimeType(head.subarray(0, cut)) : null;
    state.codec = type;
    if (!type || !MediaSource.isTypeSupported(type)) {
      reader.cancel();
      return done(type ? `${type} is not supported by this browser's MediaSource` : "no H.264 track in the header");
    }
    state.mode = "live";
    console.info("live player: streaming", type);
    const source = new MediaSource();
    const url = URL.createObjectURL(source);
    player.src = url;
    await new Promise((resolve) => source.addEventListener("sourceopen", resolve, { once: true }));
    const buffer = source.addSourceBuffer(type);
    if (onStart) onStart(url);
    await append(buffer, head, state);
    for (;;) {
      const { value, done: eof } = await reader.read();
      if (eof) break;
      parts.push(value);
      await append(buffer, value, state);
    }
    source.endOfStream();
    state.ended = true;
    return { blob: new Blob(parts, { type: "video/mp4" }), url };
  }

  return { play, mimeType, initLength, RETRY_MS, MAX_RETRIES };
})();
