// Drawing shared by the wrk dashboard and `wrk submit --report`: task streams (one lane per
// worker, one bar per task attempt, coloured by stage) and time series, on canvas, plus small
// formatting helpers. No dependencies.
"use strict";

var WrkTimeline = (function () {
  var PALETTE = [
    "#3b7dd8", "#2f9e6e", "#e08a2c", "#8a63d2", "#1fa3b3", "#c2497f",
    "#7a8b2e", "#b5651d", "#5560c9", "#3d9c3a", "#a0522d", "#d0a020",
  ];
  var FAILED = "#d64545";

  /** A stable colour per stage name. */
  function stageColor(name) {
    var h = 0;
    for (var i = 0; i < name.length; i++) {
      h = (h * 31 + name.charCodeAt(i)) >>> 0;
    }
    return PALETTE[h % PALETTE.length];
  }

  function formatBytes(n) {
    if (!isFinite(n)) return "-";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    var i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i++;
    }
    return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
  }

  /** Microseconds as a short duration. */
  function formatDuration(us) {
    if (!isFinite(us)) return "-";
    if (us < 1000) return us.toFixed(0) + " µs";
    if (us < 1e6) return (us / 1000).toFixed(us < 1e4 ? 2 : 1) + " ms";
    if (us < 120e6) return (us / 1e6).toFixed(us < 1e7 ? 2 : 1) + " s";
    return (us / 60e6).toFixed(1) + " min";
  }

  function escapeHtml(value) {
    return String(value)
      .replace(/&/g, "&amp;")
      .replace(/</g, "&lt;")
      .replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;")
      .replace(/'/g, "&#39;");
  }

  /** Sizes a canvas to its CSS width and `height` CSS pixels; returns its 2D context. */
  function setup(canvas, height) {
    var ratio = window.devicePixelRatio || 1;
    var width = canvas.clientWidth || (canvas.parentElement && canvas.parentElement.clientWidth) || 800;
    canvas.width = Math.max(1, Math.floor(width * ratio));
    canvas.height = Math.max(1, Math.floor(height * ratio));
    canvas.style.height = height + "px";
    var ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx: ctx, width: width, height: height };
  }

  /** A "nice" tick step (1, 2 or 5 times a power of ten) for `span` split in about `count`. */
  function niceStep(span, count) {
    var raw = span / Math.max(1, count);
    var power = Math.pow(10, Math.floor(Math.log10(raw)));
    var steps = [1, 2, 5, 10];
    for (var i = 0; i < steps.length; i++) {
      if (steps[i] * power >= raw) return steps[i] * power;
    }
    return 10 * power;
  }

  /** Time ticks (in microseconds) along the bottom, labelled by `label(t)`. */
  function drawAxis(ctx, x, from, to, top, left, right, label) {
    ctx.strokeStyle = "#dde1e8";
    ctx.fillStyle = "#687085";
    ctx.beginPath();
    ctx.moveTo(left, top + 0.5);
    ctx.lineTo(right, top + 0.5);
    ctx.stroke();
    var step = niceStep(to - from, Math.max(2, Math.floor((right - left) / 90)));
    for (var t = Math.ceil(from / step) * step; t <= to; t += step) {
      var px = Math.round(x(t)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(px, top);
      ctx.lineTo(px, top + 4);
      ctx.stroke();
      var text = label(t);
      if (px + 2 + ctx.measureText(text).width <= right + 6) ctx.fillText(text, px + 2, top + 14);
    }
  }

  /**
   * Rows within each lane so that overlapping attempts (a worker runs several at once) do not
   * hide each other: attempts go, by start time, to the first row free by then, up to
   * `maxRows[lane]` rows (the worker's slots; 16 when not given). Returns the number of rows of
   * each lane and sets `row` on each task.
   */
  function assignRows(laneCount, tasks, maxRows) {
    var ends = [];
    for (var l = 0; l < laneCount; l++) ends.push([]);
    var order = tasks.slice().sort(function (a, b) {
      return a.start - b.start;
    });
    // Ends are when the scheduler heard of them, a little after the worker's: tolerate overlaps
    // that short rather than open a row for them.
    var jitter = 2000;
    order.forEach(function (task) {
      var rows = ends[task.lane];
      var row = -1;
      for (var r = 0; r < rows.length; r++) {
        if (rows[r] <= task.start + jitter) {
          row = r;
          break;
        }
      }
      var limit = (maxRows && maxRows[task.lane]) || 16;
      if (row < 0 && rows.length < limit) {
        row = rows.length;
        rows.push(0);
      }
      if (row < 0) {
        // More at once than the worker runs (ends are when the scheduler heard of them): share
        // the row that frees up first.
        row = 0;
        for (var e = 1; e < rows.length; e++) if (rows[e] < rows[row]) row = e;
      }
      rows[row] = Math.max(rows[row], task.end);
      task.row = row;
    });
    return ends.map(function (rows) {
      return Math.max(1, rows.length);
    });
  }

  /**
   * Draws a task stream. `opts`: `lanes` (worker names), `slots` (tasks each lane's worker runs
   * at once, optional), `tasks` (objects with `lane`, `start`, `end` in microseconds, `stage`
   * name and `ok`), the window `from`..`to` and `tickLabel(t)`.
   * A worker running several attempts at once gets a row for each. Returns `hit(x, y)`, the
   * task under a point in CSS pixels of the canvas (or null), and `drawn`, the number of bars
   * drawn.
   */
  function drawStream(canvas, opts) {
    var lanes = opts.lanes;
    var visible = opts.tasks.filter(function (task) {
      return task.lane >= 0 && task.lane < lanes.length && task.end >= opts.from && task.start <= opts.to;
    });
    var rows = assignRows(lanes.length, visible, opts.slots);
    var firstRow = [];
    var totalRows = 0;
    rows.forEach(function (count) {
      firstRow.push(totalRows);
      totalRows += count;
    });
    var rowHeight = Math.max(2, Math.min(18, Math.floor(480 / Math.max(1, totalRows))));
    var label = rowHeight >= 9 || lanes.length <= 40 ? 110 : 0;
    var axis = 20;
    var g = setup(canvas, totalRows * rowHeight + axis + 2);
    var ctx = g.ctx;
    var left = label;
    var right = g.width - 6;
    var span = Math.max(1, opts.to - opts.from);
    var x = function (t) {
      return left + ((t - opts.from) / span) * (right - left);
    };
    for (var l = 0; l < lanes.length; l++) {
      var top = firstRow[l] * rowHeight;
      if (l % 2 === 1) {
        ctx.fillStyle = "#f3f5f8";
        ctx.fillRect(left, top, right - left, rows[l] * rowHeight);
      }
      if (label && rowHeight * rows[l] >= 9) {
        ctx.fillStyle = "#1d2330";
        ctx.fillText(lanes[l].length > 17 ? lanes[l].slice(0, 16) + "…" : lanes[l], 2,
          top + Math.min(rows[l] * rowHeight, 18) / 2 + 4);
      }
    }
    var boxes = [];
    var pad = rowHeight >= 6 ? 1 : 0;
    visible.forEach(function (task) {
      var x0 = Math.max(left, x(task.start));
      var x1 = Math.min(right, Math.max(x0 + 1, x(task.end)));
      var y0 = (firstRow[task.lane] + task.row) * rowHeight + pad;
      var h = rowHeight - 2 * pad;
      ctx.fillStyle = task.ok ? stageColor(task.stage) : FAILED;
      ctx.fillRect(x0, y0, x1 - x0, h);
      if (x1 - x0 > 3 && h > 4) {
        ctx.strokeStyle = "rgba(255,255,255,0.7)";
        ctx.strokeRect(x0 + 0.5, y0 + 0.5, x1 - x0 - 1, h - 1);
      }
      boxes.push([x0, y0, x1, y0 + h, task]);
    });
    drawAxis(ctx, x, opts.from, opts.to, totalRows * rowHeight + 1, left, right, opts.tickLabel);
    return {
      drawn: boxes.length,
      hit: function (px, py) {
        for (var b = boxes.length - 1; b >= 0; b--) {
          var box = boxes[b];
          if (px >= box[0] - 1 && px <= box[2] + 1 && py >= box[1] && py <= box[3]) return box[4];
        }
        return null;
      },
    };
  }

  /**
   * Draws time series as lines. `opts`: `series` (objects with `name`, `color`, `points` as
   * `[t, value]` sorted by time), `from`..`to` in microseconds, `height`, `yLabel(v)`,
   * `tickLabel(t)`, `steps` (hold each value until the next point) and `empty` (the text shown
   * without data). Returns the number of points drawn.
   */
  function drawSeries(canvas, opts) {
    var g = setup(canvas, opts.height || 140);
    var ctx = g.ctx;
    var left = 64;
    var right = g.width - 6;
    var top = 6;
    var bottom = g.height - 20;
    var max = 0;
    opts.series.forEach(function (s) {
      s.points.forEach(function (p) {
        if (p[0] >= opts.from && p[0] <= opts.to && p[1] > max) max = p[1];
      });
    });
    var span = Math.max(1, opts.to - opts.from);
    if (max <= 0) {
      ctx.fillStyle = "#687085";
      ctx.fillText(opts.empty || "no data in this window", left, (top + bottom) / 2);
      return 0;
    }
    var x = function (t) {
      return left + ((t - opts.from) / span) * (right - left);
    };
    var y = function (v) {
      return bottom - (v / max) * (bottom - top);
    };
    ctx.fillStyle = "#687085";
    ctx.strokeStyle = "#eef0f4";
    var ystep = niceStep(max, 3);
    for (var v = 0; v <= max; v += ystep) {
      var py = Math.round(y(v)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(left, py);
      ctx.lineTo(right, py);
      ctx.stroke();
      ctx.fillText(opts.yLabel(v), 2, py + 4);
    }
    var drawn = 0;
    opts.series.forEach(function (s) {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      var started = false;
      var last = 0;
      s.points.forEach(function (p) {
        if (p[0] < opts.from || p[0] > opts.to) return;
        if (started) {
          if (opts.steps) ctx.lineTo(x(p[0]), y(last));
          ctx.lineTo(x(p[0]), y(p[1]));
        } else {
          ctx.moveTo(x(p[0]), y(p[1]));
          started = true;
        }
        last = p[1];
        drawn++;
      });
      ctx.stroke();
      ctx.lineWidth = 1;
    });
    drawAxis(ctx, x, opts.from, opts.to, bottom, left, right, opts.tickLabel);
    return drawn;
  }

  /** Sums `value(item)` of items into `bins` bins of `from`..`to` by `time(item)`. */
  function bin(items, time, value, from, to, bins) {
    var width = Math.max(1, (to - from) / bins);
    var sums = new Array(bins).fill(0);
    items.forEach(function (item) {
      var t = time(item);
      if (t < from || t > to) return;
      sums[Math.min(bins - 1, Math.floor((t - from) / width))] += value(item);
    });
    return sums.map(function (sum, i) {
      return [from + (i + 0.5) * width, sum];
    });
  }

  /** A legend of stage colours as HTML, with the colour of failed attempts unless `stagesOnly`. */
  function legendHtml(stages, stagesOnly) {
    var items = stages.map(function (name) {
      return '<span><i style="background:' + stageColor(name) + '"></i>' + escapeHtml(name) + "</span>";
    });
    if (!stagesOnly) items.push('<span><i style="background:' + FAILED + '"></i>failed attempt</span>');
    return items.join("");
  }

  return {
    stageColor: stageColor,
    formatBytes: formatBytes,
    formatDuration: formatDuration,
    escapeHtml: escapeHtml,
    drawStream: drawStream,
    drawSeries: drawSeries,
    bin: bin,
    legendHtml: legendHtml,
  };
})();
