// linserve playground: plain JavaScript, no build step, no network beyond this server.
// Streams completions and chat over SSE, keeps sessions (create, continue, fork side by side,
// export, import, delete) and shows live figures. The API key, when the server needs one,
// lives in sessionStorage and only ever travels in the Authorization header.
"use strict";

(() => {
  const KEY_STORAGE = "linserve.apiKey";
  const $ = (id) => document.getElementById(id);
  const ui = {
    model: $("model"), auth: $("auth"), authForm: $("auth-form"), apiKey: $("api-key"),
    forgetKey: $("forget-key"), error: $("error"), prompt: $("prompt"),
    promptLabel: $("prompt-label"), generate: $("generate"), stop: $("stop-button"),
    clear: $("clear"), panes: $("panes"), useSession: $("use-session"),
    sessionInfo: $("session-info"), newSession: $("new-session"), fork: $("fork-session"),
    exportSession: $("export-session"), deleteSession: $("delete-session"),
    importFile: $("import-file"), chart: $("chart"), serverFigures: $("server-figures"),
    template: $("pane-template"), images: $("images"), imageFile: $("image-file"),
    attached: $("attached"),
  };
  const app = { model: null, panes: [], controllers: [], running: false, images: [] };

  // ---- HTTP -------------------------------------------------------------------------
  function apiKey() { return sessionStorage.getItem(KEY_STORAGE) || ""; }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return body.error.message;
      return JSON.stringify(body);
    } catch (_) {
      return "HTTP " + response.status + " " + response.statusText;
    }
  }

  async function call(method, path, body, options) {
    const init = { method: method, headers: headers(options && options.headers) };
    if (body !== undefined) {
      init.body = (body instanceof Blob) ? body : JSON.stringify(body);
      if (!(body instanceof Blob)) init.headers["Content-Type"] = "application/json";
    }
    if (options && options.signal) init.signal = options.signal;
    const response = await fetch(path, init);
    if (response.status === 401) showAuth();
    if (!response.ok) throw new Error(await errorMessage(response));
    return response;
  }

  async function* sseEvents(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = frame.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  }

  // ---- messages and figures -----------------------------------------------------------
  function showError(message) {
    ui.error.textContent = message;
    ui.error.hidden = false;
  }

  function clearError() {
    ui.error.hidden = true;
    ui.error.textContent = "";
  }

  function formatBytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
  }

  function setStats(dl, entries) {
    dl.replaceChildren();
    for (const [name, value] of entries) {
      const dt = document.createElement("dt");
      dt.textContent = name;
      const dd = document.createElement("dd");
      dd.textContent = value;
      dl.append(dt, dd);
    }
  }

  function showAuth() {
    ui.auth.hidden = false;
    ui.apiKey.focus();
  }

  async function loadModel() {
    try {
      const body = await (await call("GET", "/v1/models")).json();
      app.model = body.data[0];
      const m = app.model;
      const growing = m.state_grows;
      const fixed = m.state_bytes > 0 ? formatBytes(m.state_bytes) + " constant state + " : "";
      ui.model.textContent = "Model " + m.id + " · " + m.architecture + " · " +
        (growing ? fixed + "a KV cache of " + formatBytes(m.state_bytes_per_token || 0) +
                   " per token (max " + m.max_model_len + ")"
                 : "constant state of " + formatBytes(m.state_bytes) + " per session");
      ui.images.hidden = !(m.input_modalities || []).includes("image");
      ui.auth.hidden = true;
      clearError();
    } catch (err) {
      ui.model.textContent = "not connected";
      showError(err.message);
    }
  }

  // ---- panes ------------------------------------------------------------------------
  function newPane(title, sessionId) {
    const node = ui.template.content.firstElementChild.cloneNode(true);
    const pane = { node: node, title: node.querySelector(".pane-title"),
                   out: node.querySelector(".output"), stats: node.querySelector(".stats"),
                   sessionId: sessionId || null, messages: [], points: [], started: false };
    pane.title.textContent = title;
    ui.panes.append(node);
    app.panes.push(pane);
    return pane;
  }

  function resetPanes(sessionId, title) {
    ui.panes.replaceChildren();
    app.panes = [];
    newPane(title || "Output", sessionId);
    refreshSessionUi();
    drawChart();
  }

  function appendText(pane, text, cls) {
    const span = document.createElement("span");
    if (cls) span.className = cls;
    span.textContent = text;
    pane.out.append(span);
    scrollToEnd(pane);
    return span;
  }

  // Reading scrollHeight forces a layout of the whole output; doing it once a frame rather
  // than once a chunk keeps a long stream's rendering linear, so the page (and Stop) keeps up.
  function scrollToEnd(pane) {
    if (pane.scrollPending) return;
    pane.scrollPending = true;
    requestAnimationFrame(() => {
      pane.scrollPending = false;
      pane.out.scrollTop = pane.out.scrollHeight;
    });
  }

  function refreshSessionUi() {
    const a = app.panes[0];
    const has = Boolean(a && a.sessionId);
    ui.fork.disabled = !has || app.running;
    ui.exportSession.disabled = !has || app.running;
    ui.deleteSession.disabled = !has || app.running;
    const names = app.panes.filter((p) => p.sessionId).map((p) => p.sessionId);
    ui.sessionInfo.textContent = names.length ? "Session " + names.join(" and fork ") :
      (ui.useSession.checked ? "A session starts with the next request." : "Stateless.");
  }

  function drawChart() {
    const svg = ui.chart;
    const ns = "http://www.w3.org/2000/svg";
    svg.replaceChildren();
    const series = app.panes.map((p) => p.points);
    const all = series.flat();
    const axis = document.createElementNS(ns, "path");
    axis.setAttribute("d", "M64 10 V160 H352");
    axis.setAttribute("class", "axis");
    svg.append(axis);
    const label = (x, y, text, anchor) => {
      const t = document.createElementNS(ns, "text");
      t.setAttribute("x", x); t.setAttribute("y", y);
      if (anchor) t.setAttribute("text-anchor", anchor);
      t.textContent = text;
      svg.append(t);
    };
    if (!all.length) {
      label(208, 90, "no session yet", "middle");
      return;
    }
    const maxX = Math.max(...all.map((p) => p.tokens), 1);
    const top = Math.max(...all.map((p) => p.bytes), 1);
    const maxY = top * 1.15;
    const px = (v) => 64 + (v / maxX) * 284;
    const py = (v) => 160 - (v / maxY) * 150;
    label(60, py(top) + 4, formatBytes(top), "end");
    label(60, 160, "0", "end");
    label(64, 176, "0");
    label(352, 176, maxX + " tokens", "end");
    const m = app.model;
    if (m && m.state_grows && m.state_bytes > 0) {  // a hybrid: the constant part, then KV
      const y = py(Math.min(m.state_bytes, top));
      const base = document.createElementNS(ns, "line");
      base.setAttribute("x1", 64); base.setAttribute("x2", 352);
      base.setAttribute("y1", y); base.setAttribute("y2", y);
      base.setAttribute("class", "constant-part");
      svg.append(base);
      label(348, y - 4, "constant part " + formatBytes(m.state_bytes) + "; above: KV cache",
            "end");
    }
    series.forEach((points, i) => {
      if (!points.length) return;
      const line = document.createElementNS(ns, "polyline");
      line.setAttribute("points", points.map((p) => px(p.tokens) + "," + py(p.bytes)).join(" "));
      line.setAttribute("class", "series-" + (i % 2));
      svg.append(line);
      for (const p of points) {
        const dot = document.createElementNS(ns, "circle");
        dot.setAttribute("cx", px(p.tokens)); dot.setAttribute("cy", py(p.bytes));
        dot.setAttribute("r", 3); dot.setAttribute("class", "dot-" + (i % 2));
        svg.append(dot);
      }
    });
  }

  // ---- generation ---------------------------------------------------------------------
  function readParams(offset) {
    const num = (id) => { const v = $(id).value; return v === "" ? undefined : Number(v); };
    const params = { temperature: num("temperature"), top_p: num("top_p"),
                     top_k: num("top_k"), min_p: num("min_p"), max_tokens: num("max_tokens") };
    const seed = num("seed");
    if (seed !== undefined) params.seed = seed + offset;
    const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
    if (stop.length) params.stop = stop;
    return params;
  }

  function mode() { return document.querySelector("input[name=mode]:checked").value; }

  async function ensureSession(pane) {
    if (!ui.useSession.checked || pane.sessionId) return;
    const info = await (await call("POST", "/v1/sessions", { prompt: "" })).json();
    pane.sessionId = info.id;
    refreshSessionUi();
  }

  // ---- images (a vision-language model, chat mode) -------------------------------------
  function attachFiles(files) {
    for (const file of files) {
      if (!file.type.startsWith("image/")) continue;
      const reader = new FileReader();
      reader.onload = () => { app.images.push(reader.result); showAttached(); };
      reader.readAsDataURL(file);
    }
  }

  function thumb(url, label) {
    const img = document.createElement("img");
    img.className = "thumb";
    img.src = url;
    img.alt = label;
    return img;
  }

  function showAttached() {
    ui.attached.replaceChildren(...app.images.map((url, i) => {
      const remove = document.createElement("button");
      remove.type = "button";
      remove.title = "Remove image " + (i + 1);
      remove.append(thumb(url, "attached image " + (i + 1) + " (click to remove)"));
      remove.addEventListener("click", () => { app.images.splice(i, 1); showAttached(); });
      return remove;
    }));
  }

  function userContent(prompt, images) {
    if (!images.length) return prompt;
    return [{ type: "text", text: prompt }].concat(
      images.map((url) => ({ type: "image_url", image_url: { url: url } })));
  }

  function requestFor(pane, prompt, offset, images) {
    const body = Object.assign(readParams(offset), { model: app.model ? app.model.id : undefined,
      stream: true, stream_options: { include_usage: true } });
    if (pane.sessionId) body.session_id = pane.sessionId;
    if (mode() === "chat") {
      const message = { role: "user", content: userContent(prompt, images) };
      body.messages = pane.sessionId ? [message] : pane.messages.concat([message]);
      return ["/v1/chat/completions", body];
    }
    body.prompt = prompt;
    return ["/v1/completions", body];
  }

  function showPrompt(pane, prompt, images) {
    if (mode() === "chat") {
      const turn = document.createElement("p");
      turn.className = "turn";
      const who = document.createElement("span");
      who.className = "who";
      who.textContent = "You: ";
      turn.append(who, document.createTextNode(prompt),
                  ...images.map((url, i) => thumb(url, "image " + (i + 1) + " sent")));
      pane.out.append(turn);
      appendText(pane, "", "who").textContent = "Assistant: ";
    } else if (prompt) {
      appendText(pane, prompt, "prompt");
    }
  }

  async function runPane(pane, prompt, offset, signal, images) {
    await ensureSession(pane);
    const [path, body] = requestFor(pane, prompt, offset, images);
    showPrompt(pane, prompt, images);
    const t0 = performance.now();
    let first = null;
    let text = "";
    let usage = null;
    let finish = null;
    const live = appendText(pane, "", "generated");
    const response = await call("POST", path, body, { signal: signal });
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = choice.text !== undefined ? choice.text : (choice.delta.content || "");
        if (piece && first === null) first = performance.now();
        text += piece;
        live.textContent = text;
        if (choice.finish_reason) finish = choice.finish_reason;
        scrollToEnd(pane);
      }
      showFigures(pane, t0, first, usage, text, finish);
    }
    if (mode() === "chat") {
      appendText(pane, "\n");
      if (!pane.sessionId) {
        pane.messages.push({ role: "user", content: userContent(prompt, images) },
                           { role: "assistant", content: text.trim() });
      }
    }
    showFigures(pane, t0, first, usage, text, finish);
    await afterRequest(pane);
  }

  function showFigures(pane, t0, first, usage, text, finish) {
    const now = performance.now();
    const tokens = usage ? usage.completion_tokens : null;
    const rate = (first !== null && tokens && now > first)
      ? ((tokens - 1) / ((now - first) / 1000)).toFixed(1) : "–";
    const cached = usage && usage.prompt_tokens_details
      ? usage.prompt_tokens_details.cached_tokens + " of " + usage.prompt_tokens : "–";
    pane.figures = [["TTFT", first === null ? "–" : Math.round(first - t0) + " ms"],
                    ["Tokens/s", rate],
                    ["Generated", tokens === null ? String(text.length) + " chars" : tokens + " tokens"],
                    ["Prompt tokens cached", cached],
                    ["Finish", finish || "streaming…"]];
    setStats(pane.stats, pane.figures.concat(pane.sessionFigures || []));
  }

  async function afterRequest(pane) {
    if (!pane.sessionId) return;
    const info = await (await call("GET", "/v1/sessions/" + pane.sessionId)).json();
    pane.points.push({ tokens: info.tokens, bytes: info.state_bytes });
    pane.sessionFigures = [["Tokens in session", String(info.tokens)],
                           ["State", formatBytes(info.state_bytes)]];
    setStats(pane.stats, (pane.figures || []).concat(pane.sessionFigures));
    drawChart();
  }

  function setRunning(running) {
    app.running = running;
    ui.generate.disabled = running;
    ui.stop.disabled = !running;
    refreshSessionUi();
  }

  async function generate() {
    if (app.running) return;
    clearError();
    const prompt = ui.prompt.value;
    const images = mode() === "chat" ? app.images.splice(0) : [];
    showAttached();
    const controller = new AbortController();
    app.controllers = [controller];
    setRunning(true);
    const runs = app.panes.map((pane, i) => runPane(pane, prompt, i, controller.signal, images)
      .catch((err) => {
        if (err.name === "AbortError") {
          appendText(pane, " [stopped]", "prompt");
          return afterRequest(pane).catch(() => undefined);
        }
        showError(err.message);
        return undefined;
      }));
    await Promise.all(runs);
    setRunning(false);
    if (mode() === "chat") ui.prompt.value = "";
    ui.prompt.focus();
  }

  function stop() {
    for (const c of app.controllers) c.abort();
    app.controllers = [];
  }

  // ---- sessions -------------------------------------------------------------------------
  async function fork() {
    clearError();
    const a = app.panes[0];
    try {
      const info = await (await call("POST", "/v1/sessions/" + a.sessionId + "/fork")).json();
      while (app.panes.length > 1) app.panes.pop().node.remove();
      a.title.textContent = "Branch A";
      const b = newPane("Branch B (fork)", info.id);
      b.out.append(...Array.from(a.out.childNodes, (n) => n.cloneNode(true)));
      b.points = a.points.slice();
      refreshSessionUi();
      drawChart();
    } catch (err) {
      showError(err.message);
    }
  }

  async function exportSession() {
    clearError();
    const id = app.panes[0].sessionId;
    try {
      const blob = await (await call("GET", "/v1/sessions/" + id + "/state")).blob();
      const url = URL.createObjectURL(blob);
      const link = document.createElement("a");
      link.href = url;
      link.download = id + ".safetensors";
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (err) {
      showError(err.message);
    }
  }

  async function importSession() {
    clearError();
    const file = ui.importFile.files[0];
    if (!file) return;
    try {
      const info = await (await call("POST", "/v1/sessions/import", file,
        { headers: { "Content-Type": "application/octet-stream" } })).json();
      ui.useSession.checked = true;
      resetPanes(info.id, "Imported session");
      appendText(app.panes[0], "[imported: " + info.tokens + " tokens]\n", "prompt");
      app.panes[0].points.push({ tokens: info.tokens, bytes: info.state_bytes });
      drawChart();
    } catch (err) {
      showError(err.message);
    }
    ui.importFile.value = "";
  }

  async function deleteSession() {
    clearError();
    try {
      for (const pane of app.panes) {
        if (pane.sessionId) await call("DELETE", "/v1/sessions/" + pane.sessionId);
      }
      resetPanes(null);
    } catch (err) {
      showError(err.message);
    }
  }

  // ---- server figures ---------------------------------------------------------------------
  const METRICS = [["linserve_num_requests_running", "Requests running"],
                   ["linserve_num_requests_waiting", "Requests waiting"],
                   ["linserve_prefix_cache_hit_rate", "Prefix-cache hit rate"],
                   ["linserve_prefix_cache_entries", "Prefix-cache entries"],
                   ["linserve_sessions", "Sessions on the server"]];

  async function pollMetrics() {
    if (document.hidden) return;
    try {
      const text = await (await fetch("/metrics")).text();
      const values = {};
      for (const line of text.split("\n")) {
        const m = line.match(/^([a-z_]+) ([0-9.eE+-]+)$/);
        if (m) values[m[1]] = Number(m[2]);
      }
      setStats(ui.serverFigures, METRICS.filter(([k]) => k in values).map(([k, name]) =>
        [name, k.endsWith("hit_rate") ? (100 * values[k]).toFixed(1) + " %"
                                      : String(Math.round(values[k]))]));
    } catch (_) { /* the figures simply stay as they were */ }
  }

  // ---- wiring ---------------------------------------------------------------------------
  function wire() {
    ui.generate.addEventListener("click", generate);
    ui.stop.addEventListener("click", stop);
    ui.clear.addEventListener("click", () => { clearError(); resetPanes(null); });
    ui.newSession.addEventListener("click", () => { ui.useSession.checked = true; resetPanes(null); });
    ui.fork.addEventListener("click", fork);
    ui.exportSession.addEventListener("click", exportSession);
    ui.deleteSession.addEventListener("click", deleteSession);
    ui.importFile.addEventListener("change", importSession);
    ui.useSession.addEventListener("change", () => resetPanes(null));
    for (const radio of document.querySelectorAll("input[name=mode]")) {
      radio.addEventListener("change", () => {
        ui.promptLabel.textContent = mode() === "chat" ? "Message" : "Prompt";
        resetPanes(null);
      });
    }
    ui.imageFile.addEventListener("change", () => { attachFiles(ui.imageFile.files); ui.imageFile.value = ""; });
    ui.prompt.addEventListener("paste", (e) => {
      const files = Array.from(e.clipboardData ? e.clipboardData.files : []);
      if (files.length && !ui.images.hidden) { e.preventDefault(); attachFiles(files); }
    });
    ui.prompt.addEventListener("dragover", (e) => { if (!ui.images.hidden) e.preventDefault(); });
    ui.prompt.addEventListener("drop", (e) => {
      if (ui.images.hidden || !e.dataTransfer || !e.dataTransfer.files.length) return;
      e.preventDefault();
      attachFiles(e.dataTransfer.files);
    });
    ui.prompt.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); generate(); }
    });
    document.addEventListener("keydown", (e) => { if (e.key === "Escape") stop(); });
    ui.authForm.addEventListener("submit", (e) => {
      e.preventDefault();
      sessionStorage.setItem(KEY_STORAGE, ui.apiKey.value.trim());
      ui.apiKey.value = "";
      ui.auth.hidden = true;
      loadModel();
    });
    ui.forgetKey.addEventListener("click", () => {
      sessionStorage.removeItem(KEY_STORAGE);
      showAuth();
    });
  }

  wire();
  resetPanes(null);
  loadModel();
  pollMetrics();
  setInterval(pollMetrics, 1000);
})();
