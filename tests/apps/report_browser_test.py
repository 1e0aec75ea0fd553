#!/usr/bin/env python3
"""`strata report`'s page in a real browser: headless Chromium loads index.html
of a `strata report --tiny --device host` run and

  * every <svg> and <img> of the page has a non-zero box, and no legend label
    covers a data point or bar (a copy of the page
    with a test-only script appended writes each element's bounding box into
    the DOM, which --dump-dom prints; the page itself has no script);
  * a screenshot of the whole page is not blank (decoded here: many distinct
    colours, a share of non-white pixels, and the charts' colours present);
  * the two `strata train --plot` SVGs (gnuplot) render with a non-zero box
    and a non-blank screenshot, no legend label covers a bar, and the x axis
    starts at step 1 (no negative tick), when gnuplot is installed.

Exit 77 (CTest's skip) when chromium is not installed, saying so.
  report_browser_test.py STRATA_BINARY [KEEP_DIR]
KEEP_DIR (or $STRATA_REPORT_SHOTS): where to keep the screenshots to look at.
"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib

SKIP = 77


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium(browser, profile, *args, timeout=90):
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--no-first-run", "--user-data-dir=" + profile, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def decode_png(path):
    """(width, height, channels, rows of bytes) of an 8-bit, non-interlaced PNG."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path + ": not a PNG"
    pos, idat, hdr = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            hdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = hdr
    assert depth == 8 and interlace == 0, f"{path}: depth {depth}, interlace {interlace}"
    channels = {2: 3, 6: 4, 0: 1, 4: 2}[colour]
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, channels, rows


def screenshot_stats(path):
    """Distinct colours, share of non-white pixels, and the set of colours (sampled)."""
    width, height, ch, rows = decode_png(path)
    colours, nonwhite, total = set(), 0, 0
    for y in range(0, height, 2):
        row = rows[y]
        for x in range(0, width, 2):
            px = row[x * ch:x * ch + 3] if ch >= 3 else row[x * ch:x * ch + 1] * 3
            colours.add(px)
            total += 1
            if min(px) < 235:
                nonwhite += 1
    return len(colours), nonwhite / max(1, total), colours


def svg_page(svg_path, work):
    """An HTML page showing the SVG file inline at 800x450 (gnuplot's size)."""
    page = os.path.join(work, "page_" + os.path.basename(svg_path) + ".html")
    svg = open(svg_path, encoding="utf-8").read()
    svg = svg[svg.find("<svg"):]
    with open(page, "w", encoding="utf-8") as f:
        f.write('<!DOCTYPE html><html><body style="margin:0"><div style="width:800px;'
                'height:450px">' + svg + "</div></body></html>")
    return page


def boxes(browser, profile, html_path, work, legend=()):
    """{'svg': [(w, h)], 'img': [(w, h)], 'height': page height} as rendered; with
    `legend` (the legend's labels, or "<start>": every start-anchored text,
    as the report's charts write their legends), also 'legend': their boxes and
    'filled': the boxes of the filled shapes (bars, swatches; not the
    background), each [left, top, right, bottom]."""
    probe = os.path.join(work, "probe_" + os.path.basename(html_path))
    src = open(html_path, encoding="utf-8").read()
    # Test-only: the page itself has no script.
    script = ("<script>window.addEventListener('load',function(){var o={svg:[],img:[],"
              "height:document.documentElement.scrollHeight};['svg','img'].forEach(function(t){"
              "document.querySelectorAll(t).forEach(function(e){var r=e.getBoundingClientRect();"
              "o[t].push([r.width,r.height]);});});"
              "var L=" + json.dumps(list(legend)) + ";o.legend=[];o.filled=[];"
              "function b(e){var r=e.getBoundingClientRect();return [r.left,r.top,r.right,r.bottom];}"
              "document.querySelectorAll('svg').forEach(function(svg){var s=svg.getBoundingClientRect();"
              "svg.querySelectorAll('text').forEach(function(t){"
              "if(L.indexOf(t.textContent.trim())>=0||(L[0]=='<start>'&&"
              "t.getAttribute('text-anchor')=='start'))o.legend.push(b(t));});"
              "svg.querySelectorAll('polygon,rect,path,circle').forEach(function(e){"
              "var f=e.getAttribute('fill');if(!f||f=='none')return;var r=e.getBoundingClientRect();"
              "var a=r.width*r.height;if(a>0&&a<0.25*s.width*s.height)o.filled.push(b(e));});});"
              "var p=document.createElement('pre');"
              "p.id='strata-boxes';p.textContent=JSON.stringify(o);document.body.appendChild(p);"
              "});</script>")
    if "</body>" in src:
        src = src.replace("</body>", script + "</body>")
    else:  # a bare SVG: the wrapper of svg_page() with the script
        src = open(svg_page(html_path, work), encoding="utf-8").read().replace(
            "</body>", script + "</body>")
        probe += ".html"
    with open(probe, "w", encoding="utf-8") as f:
        f.write(src)
    r = chromium(browser, profile, "--virtual-time-budget=5000", "--dump-dom",
                 "file://" + probe)
    m = re.search(r'<pre id="strata-boxes">(.*?)</pre>', r.stdout, re.S)
    assert m, f"{html_path}: no boxes in the DOM (chromium exit {r.returncode}): {r.stderr[-800:]}"
    return json.loads(m.group(1).replace("&quot;", '"'))


def overlaps(a, b):
    return a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5


def check_page(browser, profile, path, work, shot, min_svgs, palette=(), legend=()):
    b = boxes(browser, profile, path, work, legend)
    if legend:
        assert len(b["legend"]) >= (min_svgs if legend[0] == "<start>" else len(legend)), \
            f"{path}: legend labels found: {b['legend']}"
        for t in b["legend"]:
            for f in b["filled"]:
                assert not overlaps(t, f), f"{path}: a legend label {t} covers a bar {f}"
    n = len(b["svg"]) + len(b["img"])
    assert len(b["svg"]) >= min_svgs, f"{path}: {len(b['svg'])} <svg> rendered, want {min_svgs}"
    for kind in ("svg", "img"):
        for i, (w, h) in enumerate(b[kind]):
            assert w > 0 and h > 0, f"{path}: <{kind}> #{i} has an empty box {w}x{h}"
    if path.endswith(".svg"):
        size, url = "800,450", svg_page(path, work)
    else:
        size, url = f"1200,{max(300, min(int(b['height']) + 20, 12000))}", path
    r = chromium(browser, profile, f"--window-size={size}", "--screenshot=" + shot,
                 "file://" + os.path.abspath(url))
    assert os.path.exists(shot), f"{path}: no screenshot (exit {r.returncode}): {r.stderr[-800:]}"
    ncol, ink, colours = screenshot_stats(shot)
    assert ncol >= 16 and ink >= 0.01, f"{shot}: looks blank ({ncol} colours, {ink:.3%} ink)"
    for hexcol in palette:
        rgb = bytes(int(hexcol[i:i + 2], 16) for i in (1, 3, 5))
        assert rgb in colours, f"{shot}: the charts' colour {hexcol} is not on the page"
    print(f"{path}: {n} svg/img with non-zero boxes; {len(b['legend'])} legend labels clear of "
          f"{len(b['filled'])} filled marks; screenshot {shot}: {ncol} colours, {ink:.1%} ink")


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    strata = sys.argv[1]
    keep = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("STRATA_REPORT_SHOTS", "")
    browser = find_chromium()
    if not browser:
        print("SKIP: chromium is not installed (scripts/setup.sh --tests installs Debian's "
              "chromium)")
        return SKIP
    work = tempfile.mkdtemp(prefix="strata-report-browser-")
    try:
        profile = os.path.join(work, "profile")
        out = os.path.join(work, "report")
        r = subprocess.run([strata, "report", "--tiny", "--device", "host", "--out", out],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"strata report exit {r.returncode}:\n{r.stdout}\n{r.stderr}"
        shots = keep or work
        os.makedirs(shots, exist_ok=True)
        # The charts' lines in the first two palette colours must be drawn.
        check_page(browser, profile, os.path.join(out, "index.html"), work,
                   os.path.join(shots, "report.png"), min_svgs=6, palette=("#0072B2", "#E69F00"),
                   legend=("<start>",))  # the page's legend labels are its start-anchored texts
        if shutil.which("gnuplot"):
            plots = os.path.join(work, "plots")
            r = subprocess.run([strata, "train", "--config", os.path.join(out, "configs",
                                                                          "cpu_cpu.json"),
                                "--steps", "12", "--device", "host", "--plot", plots],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, f"strata train --plot exit {r.returncode}: {r.stderr}"
            legend = {"loss": ("loss",),
                      "step_time": ("compute", "fetch wait (PCIe/NVMe)",
                                    "waiting for the optimizer", "other")}
            for name in ("loss", "step_time"):
                svg = os.path.join(plots, name + ".svg")
                check_page(browser, profile, svg, work, os.path.join(shots, name + ".png"),
                           min_svgs=1, legend=legend[name])
                # The x axis starts at step 1: no negative tick label, "1" among them.
                labels = re.findall(r"<tspan[^>]*>\s*(-?[0-9.]+)\s*</tspan>",
                                    open(svg, encoding="utf-8").read())
                assert labels and "1" in labels, f"{svg}: no tick at step 1 in {labels}"
                assert not any(float(v) < 0 for v in labels), f"{svg}: negative ticks {labels}"
        else:
            print("gnuplot not installed: the train --plot SVGs not checked")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
