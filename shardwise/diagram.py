"""A picture of a plan: each pod a frame, each GPU a box labelled with its rank and groups.

A GPU box is filled with its TP group's colour, carries a band on top in its DPA group's colour and one at
the bottom in its PP stage's colour, and its text names rank, TP, CP, DPA, PP and EP coordinates.
`draw(plan)` returns plain shapes; `to_svg` and `to_png` render the same shapes.
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass
from pathlib import Path

from shardwise.planner import Plan

BOX_W, BOX_H, GAP, PAD, TITLE_H = 118, 84, 8, 14, 26
KEY_X, KEY_STEP, KEY_ROW_H, KEY_SWATCHES = 150, 62, 20, 12
PER_ROW = 8
MAX_PODS = 64


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    stroke: str = "#333333"


@dataclass(frozen=True)
class Text:
    x: float
    y: float
    text: str
    size: int = 11
    bold: bool = False


@dataclass(frozen=True)
class Diagram:
    width: float
    height: float
    shapes: tuple[Rect | Text, ...]


def colour(i: int, n: int, light: float = 0.78) -> str:
    hue = (i * 0.61803398875) % 1.0 if n > 12 else i / max(n, 1)
    r, g, b = colorsys.hls_to_rgb(hue, light, 0.55)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def draw(plan: Plan) -> Diagram:
    ranks = plan.rank_table()
    if not ranks:
        raise ValueError("the plan has no rank grid to draw (invalid spec)")
    par = plan.spec.parallelism
    shapes: list[Rect | Text] = []
    per_pod = plan.gpus_per_pod
    cols = min(per_pod, PER_ROW)
    rows = -(-per_pod // cols)
    pod_w = cols * BOX_W + (cols - 1) * GAP + 2 * PAD
    pod_h = TITLE_H + rows * BOX_H + (rows - 1) * GAP + PAD
    pods = plan.pods()[:MAX_PODS]
    n_tp = plan.world_size // par.tp
    title = (
        f"{plan.model_name} on {plan.world_size} x {plan.gpu.name if plan.gpu else '?'}: "
        f"tp={par.tp} dpa={par.dpa} cp={par.cp} pp={par.pp} ep={par.ep_size}"
    )
    shapes.append(Text(PAD, 20, title, 14, True))
    y0 = 34.0
    for p, pod_ranks in enumerate(pods):
        px, py = PAD, y0 + p * (pod_h + GAP)
        shapes.append(Rect(px, py, pod_w, pod_h, "#f4f4f4", "#888888"))
        shapes.append(Text(px + PAD, py + 18, f"pod {p}  (ranks {pod_ranks[0]}-{pod_ranks[-1]})", 12, True))
        for i, r in enumerate(pod_ranks):
            info = ranks[r]
            bx = px + PAD + (i % cols) * (BOX_W + GAP)
            by = py + TITLE_H + (i // cols) * (BOX_H + GAP)
            shapes.append(Rect(bx, by, BOX_W, BOX_H, colour(r // par.tp, n_tp)))
            shapes.append(Rect(bx, by, BOX_W, 8, colour(info.dpa_group, par.dpa, 0.45), "none"))
            shapes.append(Rect(bx, by + BOX_H - 8, BOX_W, 8, colour(info.pp_stage, par.pp, 0.35), "none"))
            shapes.append(Text(bx + 6, by + 24, f"GPU {info.gpu}  rank {r}", 11, True))
            shapes.append(Text(bx + 6, by + 40, f"TP {r // par.tp}.{info.tp_rank}  CP {info.cp_rank}"))
            shapes.append(Text(bx + 6, by + 54, f"DPA {info.dpa_group}  PP {info.pp_stage}"))
            shapes.append(Text(bx + 6, by + 68, f"EP {info.ep_rank}"))
    ly = y0 + len(pods) * (pod_h + GAP) + 6
    key = _key(ly, [("fill: TP group", "TP", n_tp, 0.78), ("top band: DPA group", "DPA", par.dpa, 0.45),
                    ("bottom band: PP stage", "PP", par.pp, 0.35)])
    shapes += key
    ly = max(s.y for s in key) + 8
    if len(plan.pods()) > MAX_PODS:
        shapes.append(Text(PAD, ly + 14, f"(first {MAX_PODS} of {len(plan.pods())} pods shown)", 11))
        ly += 18
    width = max(pod_w + 2 * PAD, KEY_X + KEY_SWATCHES * KEY_STEP + 80)
    return Diagram(width, ly + 8, tuple(shapes))


def _key(y: float, rows: list[tuple[str, str, int, float]]) -> list[Rect | Text]:
    """The colour key: for each of TP, DPA and PP its swatches, numbered, the first KEY_SWATCHES of them."""
    out: list[Rect | Text] = []
    for r, (title, short, n, light) in enumerate(rows):
        ry = y + r * KEY_ROW_H
        out.append(Text(PAD, ry + 12, title, 11))
        for i in range(min(n, KEY_SWATCHES)):
            x = KEY_X + i * KEY_STEP
            out.append(Rect(x, ry + 2, 14, 12, colour(i, n, light)))
            out.append(Text(x + 17, ry + 12, f"{short} {i}", 9))
        if n > KEY_SWATCHES:
            out.append(Text(KEY_X + KEY_SWATCHES * KEY_STEP, ry + 12, f"... {n} in all", 9))
    return out


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_svg(d: Diagram) -> str:
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{d.width:.0f}" height="{d.height:.0f}" '
        f'viewBox="0 0 {d.width:.0f} {d.height:.0f}" font-family="DejaVu Sans, Arial, sans-serif">',
        f'<rect width="{d.width:.0f}" height="{d.height:.0f}" fill="white"/>',
    ]
    for s in d.shapes:
        if isinstance(s, Rect):
            stroke = 'stroke="none"' if s.stroke == "none" else f'stroke="{s.stroke}"'
            out.append(f'<rect x="{s.x:.1f}" y="{s.y:.1f}" width="{s.w:.1f}" height="{s.h:.1f}" '
                       f'fill="{s.fill}" {stroke} rx="3"/>')
        else:
            weight = ' font-weight="bold"' if s.bold else ""
            out.append(f'<text x="{s.x:.1f}" y="{s.y:.1f}" font-size="{s.size}"{weight}>{_esc(s.text)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def to_png(d: Diagram, path: Path) -> None:
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (int(d.width), int(d.height)), "white")
    pen = ImageDraw.Draw(img)
    fonts: dict[tuple[int, bool], ImageFont.ImageFont | ImageFont.FreeTypeFont] = {}

    def font(size: int, bold: bool) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
        if (size, bold) not in fonts:
            name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
            try:
                fonts[size, bold] = ImageFont.truetype(name, size)
            except OSError:
                fonts[size, bold] = ImageFont.load_default()
        return fonts[size, bold]

    for s in d.shapes:
        if isinstance(s, Rect):
            outline = None if s.stroke == "none" else s.stroke
            pen.rectangle([s.x, s.y, s.x + s.w, s.y + s.h], fill=s.fill, outline=outline)
        else:
            pen.text((s.x, s.y - s.size), s.text, fill="black", font=font(s.size, s.bold))
    img.save(path, format="PNG")


def write(plan: Plan, path: Path) -> None:
    """Write the diagram as SVG or PNG by the file's extension; ValueError for any other."""
    suffix = path.suffix.lower()
    if suffix not in (".svg", ".png"):
        raise ValueError(f"--diagram wants a .svg or .png file, got {path.name!r}")
    d = draw(plan)
    if suffix == ".svg":
        path.write_text(to_svg(d))
    else:
        to_png(d, path)
