// The wrk dashboard: polls the scheduler's JSON endpoints once a second (task executions and
// transfers by cursor, so each poll carries only what is new) and draws workers, the task
// stream, jobs and transfers. Keeps at most MAX_RECORDS of each in the browser.
"use strict";

(function () {
  var T = WrkTimeline;
  var MAX_RECORDS = 50000;
  var PAGE = 5000;
  var POLL_MS = 1000;
  var s = {
    cursors: { tasks: null, transfers: null },
    tasks: [],
    transfers: [],
    workers: [],
    jobs: [],
    ready: 0,
    serverNowUs: 0,
    polledAt: 0,
    windowUs: 60e6,
    stream: null,
  };

  function $(id) {
    return document.getElementById(id);
  }

  function getJSON(path) {
    return fetch(path, { cache: "no-store" }).then(function (response) {
      if (!response.ok) throw new Error(path + " answered " + response.status);
      return response.json();
    });
  }

  /** Reads the new records of `kind` page by page, from the last cursor on. */
  function pull(kind, list) {
    var pages = 0;
    function next() {
      var cursor = s.cursors[kind];
      var url = "api/" + kind + "?limit=" + PAGE + (cursor === null ? "" : "&since=" + cursor);
      return getJSON(url).then(function (page) {
        for (var i = 0; i < page.items.length; i++) list.push(page.items[i]);
        s.cursors[kind] = page.next;
        pages++;
        if (page.items.length === PAGE && pages < 20) return next();
        if (list.length > MAX_RECORDS) list.splice(0, list.length - MAX_RECORDS);
        return null;
      });
    }
    return next();
  }

  function nowUs() {
    return s.serverNowUs + (performance.now() - s.polledAt) * 1000;
  }

  function setStatus(text, live) {
    var status = $("status");
    status.textContent = text;
    status.className = live ? "live" : "down";
  }

  function poll() {
    Promise.all([getJSON("api/workers"), getJSON("api/jobs")])
      .then(function (answers) {
        s.workers = answers[0].workers;
        s.ready = answers[0].ready_tasks;
        s.jobs = answers[1].jobs;
        s.serverNowUs = answers[0].now_us;
        s.polledAt = performance.now();
        return pull("tasks", s.tasks).then(function () {
          return pull("transfers", s.transfers);
        });
      })
      .then(function () {
        render();
        setStatus("live", true);
      })
      .catch(function (error) {
        setStatus("no answer from the scheduler (" + error.message + "); retrying", false);
      })
      .then(function () {
        setTimeout(poll, POLL_MS);
      });
  }

  /** Lanes of the stream: attached workers, then workers that ran recent tasks and left. */
  function lanes() {
    var names = s.workers.map(function (w) {
      return w.id;
    });
    var known = new Set(names);
    s.tasks.forEach(function (t) {
      if (!known.has(t.worker)) {
        known.add(t.worker);
        names.push(t.worker);
      }
    });
    return names;
  }

  function drawStream() {
    var names = lanes();
    var index = new Map();
    names.forEach(function (name, i) {
      index.set(name, i);
    });
    var now = nowUs();
    var from = now - s.windowUs;
    var stages = [];
    var seen = new Set();
    var tasks = [];
    s.tasks.forEach(function (t) {
      if (t.end_us < from) return;
      if (!seen.has(t.stage)) {
        seen.add(t.stage);
        stages.push(t.stage);
      }
      tasks.push({
        lane: index.has(t.worker) ? index.get(t.worker) : -1,
        start: t.start_us,
        end: t.end_us,
        stage: t.stage,
        ok: t.ok,
        record: t,
      });
    });
    $("legend").innerHTML = stages.length ? T.legendHtml(stages) : '<span class="empty">no task ended in this window</span>';
    var slotsOf = new Map();
    s.workers.forEach(function (w) {
      slotsOf.set(w.id, w.slots);
    });
    var slots = names.map(function (name) {
      return slotsOf.get(name) || 0;
    });
    var canvas = $("stream");
    s.stream = T.drawStream(canvas, {
      lanes: names,
      slots: slots,
      tasks: tasks,
      from: from,
      to: now,
      tickLabel: function (t) {
        var ago = Math.round((now - t) / 1e6);
        return ago === 0 ? "now" : "-" + ago + " s";
      },
    });
    canvas.setAttribute("data-drawn", String(s.stream.drawn));
  }

  function drawTransfers() {
    var now = nowUs();
    var from = now - s.windowUs;
    var bins = 60;
    var binSeconds = s.windowUs / 1e6 / bins;
    var points = T.bin(s.transfers, function (t) {
      return t.at_us;
    }, function (t) {
      return t.bytes / binSeconds;
    }, from, now, bins);
    T.drawSeries($("transfer-chart"), {
      series: [{ name: "bytes/s", color: "#3b7dd8", points: points }],
      from: from,
      to: now,
      height: 120,
      yLabel: function (v) {
        return T.formatBytes(v) + "/s";
      },
      tickLabel: function (t) {
        var ago = Math.round((now - t) / 1e6);
        return ago === 0 ? "now" : "-" + ago + " s";
      },
    });
    var pairs = new Map();
    s.transfers.forEach(function (t) {
      if (t.at_us < from) return;
      var key = t.from + "\u0000" + t.to;
      var pair = pairs.get(key) || { from: t.from, to: t.to, bytes: 0, count: 0 };
      pair.bytes += t.bytes;
      pair.count += 1;
      pairs.set(key, pair);
    });
    var rows = Array.from(pairs.values())
      .sort(function (a, b) {
        return b.bytes - a.bytes;
      })
      .slice(0, 12)
      .map(function (p) {
        return "<tr><td class=mono>" + T.escapeHtml(p.from) + "</td><td class=mono>" + T.escapeHtml(p.to) +
          '</td><td class="num">' + T.formatBytes(p.bytes) + '</td><td class="num">' + p.count + "</td></tr>";
      });
    $("transfer-pairs").tBodies[0].innerHTML = rows.length
      ? rows.join("")
      : '<tr><td colspan="4" class="empty">no transfers in this window: every task read its inputs where they were</td></tr>';
  }

  // "gpu:0 NVIDIA A100 (MIG 1g.10gb) 63%": the device, and for a GPU worker its name and load.
  function deviceText(w) {
    if (!w.gpu) return w.device || "-";
    var text = (w.device || "gpu") + " " + w.gpu.name;
    if (w.gpu.mig_profile) text += " (MIG " + w.gpu.mig_profile + ")";
    if (w.gpu.sm_utilization !== null && w.gpu.sm_utilization !== undefined) text += " " + (100 * w.gpu.sm_utilization).toFixed(0) + "%";
    return text;
  }

  function deviceTitle(w) {
    if (!w.gpu) return "";
    var parts = [w.gpu.uuid];
    if (w.gpu.memory_used_bytes !== null) parts.push("memory " + T.formatBytes(w.gpu.memory_used_bytes) + " / " + T.formatBytes(w.gpu.memory_total_bytes));
    if (w.gpu.temperature_celsius !== null) parts.push(w.gpu.temperature_celsius.toFixed(0) + " C");
    if (w.gpu.power_watts !== null) parts.push(w.gpu.power_watts.toFixed(0) + " W");
    return ' title="' + T.escapeHtml(parts.join(", ")) + '"';
  }

  function renderWorkers() {
    var from = nowUs() - s.windowUs;
    var done = new Map();
    s.tasks.forEach(function (t) {
      if (t.end_us >= from && t.ok) done.set(t.worker, (done.get(t.worker) || 0) + 1);
    });
    var largest = 1;
    s.workers.forEach(function (w) {
      largest = Math.max(largest, w.pool_used_bytes);
    });
    var sized = s.workers.some(function (w) {
      return w.pool_bytes > 0;
    });
    $("workers-note").textContent = sized ? "memory: used of pool" : "memory: bars relative to the fullest worker (no pool size reported)";
    var rows = s.workers.map(function (w) {
      var capacity = Math.max(1, w.slots);
      var busy = Math.min(100, (100 * w.assigned) / capacity);
      var mem = w.pool_bytes > 0 ? w.pool_used_bytes / w.pool_bytes : w.pool_used_bytes / largest;
      var memText = T.formatBytes(w.pool_used_bytes) + (w.pool_bytes > 0 ? " / " + T.formatBytes(w.pool_bytes) : "");
      var tags = w.tags.map(function (tag) {
        return '<span class="tag">' + T.escapeHtml(tag) + "</span>";
      }).join(" ");
      return '<tr data-worker="' + T.escapeHtml(w.id) + '"><td class="mono" title="' + T.escapeHtml(w.address) + '">' + T.escapeHtml(w.id) +
        "</td><td" + deviceTitle(w) + ">" + T.escapeHtml(deviceText(w)) + '</td><td class="tags">' + tags +
        '</td><td><span class="bar" title="' + w.assigned + " assigned (running or queued) for " + w.slots + ' slots"><span class="busy" style="width:' + busy.toFixed(1) + '%"></span></span> ' + w.assigned + "/" + w.slots +
        '</td><td><span class="bar"><span class="mem" style="width:' + (100 * Math.min(1, mem)).toFixed(1) + '%"></span></span> ' + memText +
        '</td><td class="num">' + w.partitions + '</td><td class="num">' + (done.get(w.id) || 0) + "</td></tr>";
    });
    $("workers").tBodies[0].innerHTML = rows.length ? rows.join("") : '<tr><td colspan="7" class="empty">no workers attached</td></tr>';
  }

  function renderJobs() {
    var now = nowUs();
    var html = s.jobs.map(function (job) {
      var end = job.finished_us === null ? now : job.finished_us;
      var stages = job.stages.map(function (st) {
        var total = Math.max(1, st.total);
        return "<tr><td>" + T.escapeHtml(st.name) + '</td><td><span class="bar"><span class="done" style="width:' +
          ((100 * st.done) / total).toFixed(1) + '%"></span><span class="running" style="left:' + ((100 * st.done) / total).toFixed(1) +
          "%;width:" + ((100 * st.running) / total).toFixed(1) + '%"></span></span></td><td class="num">' + st.done + "/" + st.total +
          "</td><td class=muted>" + (st.running ? st.running + " running" : "") + "</td></tr>";
      }).join("");
      return '<div class="job" data-job="' + T.escapeHtml(job.id) + '"><div class="title"><b class="mono">' + T.escapeHtml(job.id) + "</b> " +
        T.escapeHtml(job.name) + ' <span class="state ' + job.state + '">' + job.state + '</span><span class="muted">' +
        T.formatDuration(end - job.submitted_us) + " · tenant " + T.escapeHtml(job.tenant) +
        (job.priority ? " · priority " + job.priority : "") + "</span></div>" +
        (job.waiting ? '<div class="waiting">' + T.escapeHtml(job.waiting) + "</div>" : "") +
        '<table class="stages">' + stages + "</table>" +
        (job.error ? '<div class="error">' + T.escapeHtml(job.error) + "</div>" : "") + "</div>";
    });
    $("jobs").innerHTML = html.length ? html.join("") : '<p class="empty">no jobs yet</p>';
  }

  function renderRecent() {
    var rows = s.tasks.slice(-40).reverse().map(function (t) {
      return '<tr data-task="' + T.escapeHtml(t.job + "/" + t.stage + "/" + t.task) + '"><td class="mono">' + T.escapeHtml(t.job) + "</td><td>" + T.escapeHtml(t.stage) +
        '</td><td class="num">' + t.task + (t.attempt > 1 ? " #" + t.attempt : "") + '</td><td class="mono">' + T.escapeHtml(t.worker) +
        '</td><td class="num">' + T.formatDuration(t.end_us - t.start_us) + '</td><td class="num">' + T.formatBytes(t.output_bytes) +
        '</td><td class="num">' + T.formatBytes(t.fetched_bytes) + "</td>" +
        (t.ok ? "<td>ok</td>" : '<td class="error">' + T.escapeHtml(t.error || "failed") + "</td>") + "</tr>";
    });
    $("recent-tasks").tBodies[0].innerHTML = rows.length ? rows.join("") : '<tr><td colspan="8" class="empty">no task has ended yet</td></tr>';
  }

  function renderSummary() {
    var slots = 0;
    var assigned = 0;
    s.workers.forEach(function (w) {
      slots += w.slots;
      assigned += w.assigned;
    });
    var now = nowUs();
    var recent = 0;
    s.tasks.forEach(function (t) {
      if (t.end_us >= now - 10e6) recent++;
    });
    var running = s.jobs.filter(function (j) {
      return j.state === "running" || j.state === "pending";
    }).length;
    $("summary").innerHTML = "<b>" + s.workers.length + "</b> workers · <b>" + assigned + "</b>/" + slots +
      " slots assigned · <b>" + s.ready + "</b> tasks ready · <b>" + (recent / 10).toFixed(1) + "</b> tasks/s · <b>" + running + "</b> jobs running";
  }

  function render() {
    renderSummary();
    renderWorkers();
    renderJobs();
    renderRecent();
    drawStream();
    drawTransfers();
  }

  function showTooltip(event) {
    var tooltip = $("tooltip");
    var canvas = $("stream");
    var rect = canvas.getBoundingClientRect();
    var task = s.stream && s.stream.hit(event.clientX - rect.left, event.clientY - rect.top);
    if (!task) {
      tooltip.style.display = "none";
      return;
    }
    var t = task.record;
    tooltip.textContent = t.job + " · stage " + t.stage + " · task " + t.task + " (attempt " + t.attempt + ")\n" +
      "worker " + t.worker + " · " + T.formatDuration(t.end_us - t.start_us) + "\n" +
      "output " + T.formatBytes(t.output_bytes) + " (" + t.output_rows + " rows) · fetched " + T.formatBytes(t.fetched_bytes) +
      (t.ok ? "" : "\n" + (t.error || "failed"));
    tooltip.style.left = event.clientX + 12 + "px";
    tooltip.style.top = event.clientY + 12 + "px";
    tooltip.style.display = "block";
  }

  $("window").addEventListener("change", function (event) {
    s.windowUs = Number(event.target.value) * 1e6;
    render();
  });
  $("stream").addEventListener("mousemove", showTooltip);
  $("stream").addEventListener("mouseleave", function () {
    $("tooltip").style.display = "none";
  });
  // Between polls the stream slides with the clock, as often as drawing it stays cheap (a
  // thousand workers' tens of thousands of bars take a while).
  function slide() {
    var cost = 0;
    if (s.polledAt) {
      var started = performance.now();
      drawStream();
      cost = performance.now() - started;
    }
    setTimeout(slide, Math.max(250, 5 * cost));
  }
  slide();
  window.addEventListener("resize", function () {
    if (s.polledAt) render();
  });
  poll();
})();
