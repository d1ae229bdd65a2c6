// Draws a wrk performance report's task stream and charts from the data embedded in the page
// (element #report-data), with the dashboard's drawing code (WrkTimeline). No network.
"use strict";

(function () {
  var T = WrkTimeline;
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var end = Math.max(1, data.duration_us);
  var stages = data.stages;
  var tasks = data.tasks.map(function (t) {
    return {
      stage: stages[t[0]] || "stage " + t[0],
      task: t[1],
      attempt: t[2],
      lane: t[3],
      start: t[4],
      end: t[5],
      ok: t[6],
    };
  });
  var since = function (t) {
    return "+" + T.formatDuration(t);
  };
  var stream = null;

  function $(id) {
    return document.getElementById(id);
  }

  function drawStream() {
    var canvas = $("stream");
    stream = T.drawStream(canvas, {
      lanes: data.workers,
      slots: data.slots,
      tasks: tasks,
      from: 0,
      to: end,
      tickLabel: since,
    });
    canvas.setAttribute("data-drawn", String(stream.drawn));
  }

  /** Tasks finished over time, by stage: each stage's curve climbs to its task count. */
  function drawProgress() {
    var series = stages.map(function (name) {
      var ends = tasks
        .filter(function (t) {
          return t.ok && t.stage === name;
        })
        .map(function (t) {
          return t.end;
        })
        .sort(function (a, b) {
          return a - b;
        });
      var points = [[0, 0]];
      ends.forEach(function (t, i) {
        points.push([t, (i + 1) * data.sampled_every]);
      });
      if (ends.length) points.push([end, ends.length * data.sampled_every]);
      return { name: name, color: T.stageColor(name), points: points };
    });
    var drawn = T.drawSeries($("progress"), {
      series: series,
      from: 0,
      to: end,
      height: 140,
      yLabel: function (v) {
        return String(Math.round(v));
      },
      tickLabel: since,
      steps: true,
      empty: "no task finished",
    });
    $("progress").setAttribute("data-drawn", String(drawn));
  }

  function drawMemory() {
    var byWorker = new Map();
    data.memory.forEach(function (m) {
      if (!byWorker.has(m[0])) byWorker.set(m[0], []);
      byWorker.get(m[0]).push([m[1], m[2]]);
    });
    var series = [];
    byWorker.forEach(function (points, worker) {
      var name = data.workers[worker] || "#" + worker;
      series.push({ name: name, color: T.stageColor(name), points: points });
    });
    var drawn = T.drawSeries($("memory"), {
      series: series,
      from: 0,
      to: end,
      height: 160,
      yLabel: T.formatBytes,
      tickLabel: since,
      empty: "no memory samples",
    });
    $("memory").setAttribute("data-drawn", String(drawn));
    $("memory-legend").innerHTML = series
      .map(function (s) {
        return '<span><i style="background:' + s.color + '"></i>' + T.escapeHtml(s.name) + "</span>";
      })
      .join("");
    $("memory-note").textContent = series.length
      ? "One sample per worker per second at most, while the job ran."
      : "No memory samples: the job ended before its workers' next heartbeat, or they have left.";
  }

  function drawTransfers() {
    var bins = 60;
    var binSeconds = end / 1e6 / bins;
    var points = T.bin(data.transfers, function (t) {
      return t[3];
    }, function (t) {
      return t[2] / binSeconds;
    }, 0, end, bins);
    var drawn = T.drawSeries($("transfer-chart"), {
      series: [{ name: "bytes/s", color: "#3b7dd8", points: points }],
      from: 0,
      to: end,
      height: 120,
      yLabel: function (v) {
        return T.formatBytes(v) + "/s";
      },
      tickLabel: since,
      empty: "no transfers: every task read its inputs where they were",
    });
    $("transfer-chart").setAttribute("data-drawn", String(drawn));
  }

  function draw() {
    $("legend").innerHTML = T.legendHtml(stages);
    $("progress-legend").innerHTML = T.legendHtml(stages, true);
    drawStream();
    drawProgress();
    drawMemory();
    drawTransfers();
    $("stream-note").textContent =
      tasks.length + " task attempts drawn" +
      (data.sampled_every > 1 ? " (one in " + data.sampled_every + ")" : "") +
      " over " + T.formatDuration(end) + " on " + data.workers.length + " workers.";
  }

  $("stream").addEventListener("mousemove", function (event) {
    var tooltip = $("tooltip");
    var rect = event.target.getBoundingClientRect();
    var t = stream && stream.hit(event.clientX - rect.left, event.clientY - rect.top);
    if (!t) {
      tooltip.style.display = "none";
      return;
    }
    tooltip.textContent = "stage " + t.stage + " · task " + t.task + " (attempt " + t.attempt + ")\n" +
      "worker " + data.workers[t.lane] + " · started +" + T.formatDuration(t.start) + " · " +
      T.formatDuration(t.end - t.start) + (t.ok ? "" : "\nfailed");
    tooltip.style.left = event.clientX + 12 + "px";
    tooltip.style.top = event.clientY + 12 + "px";
    tooltip.style.display = "block";
  });
  $("stream").addEventListener("mouseleave", function () {
    $("tooltip").style.display = "none";
  });
  window.addEventListener("resize", draw);
  draw();
  document.body.setAttribute("data-rendered", "true");
})();
