"""The motion checker: does a generated clip show what its caption names?

Given the frames and the caption's :class:`~fp4video.testmodel.scenes.SceneSpec`, three checks:

- **colour**: the pixels of the named colour (hue, saturation and value windows; white: bright and
  unsaturated), after a 3×3 opening that removes isolated pixels, form one region of a shape's size
  in at least 75% of the frames: the largest 8-connected region, holding at least 80% of the
  colour's pixels (several blobs of the colour are not one shape). Backgrounds are dimmed and
  desaturated in every training scene, so in a faithful clip only the shape has these pixels. The
  shape and motion checks read that largest region alone.
- **shape**: per frame, the region's rotation-invariant complex moments |Σ ρ² e^{ikφ}| / Σ ρ² for
  k = 2, 3, 4 about its centroid (an elongated bar has a large k = 2 term, a triangle k = 3, a
  square k = 4, a circle none) name the nearest of the four shapes' values; the caption's shape
  must win more frames than any other shape (a tie names no shape).
- **motion**: the centroid track (a least-squares line through the frames' centroids) moves at
  least 15% of the frame in the named direction and at most half as far across it; a growing
  (shrinking) region's area grows (shrinks) at least 1.8×, its centre within 15% of the frame; a
  spinning shape turns at least 40° (its k-fold moment's angle, unwrapped; a circle's turn cannot
  be seen, so only its stillness is checked).

The thresholds sit between what ground-truth renders give (moves of 35–50% of the frame, area ×4.3,
turns of 90–150°) and what a static clip gives; tests check both sides, on renders, their blurred
and wrong versions, static clips and noise.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from .scenes import DIRECTIONS, SHAPES, SIZE_RANGE, SCALE_RANGE, SceneSpec

__all__ = ["Verdict", "check_clip", "check_rate", "describe_shapes", "colour_mask", "largest_region", "shape_moments",
           "SHAPE_MOMENTS", "HUES"]

#: Hue (degrees) and half-width of the window of each chromatic colour name.
HUES = {"red": (0.0, 15.0), "orange": (30.0, 13.0), "yellow": (60.0, 15.0), "green": (120.0, 35.0),
        "cyan": (180.0, 30.0), "blue": (240.0, 30.0), "magenta": (300.0, 30.0)}
MIN_SATURATION, MIN_VALUE = 0.5, 0.5  # a chromatic colour's pixels
WHITE_MAX_SATURATION, WHITE_MIN_VALUE = 0.25, 0.8  # white's pixels

#: (|m2|, |m3|, |m4|) of the ideal shapes (measured on renders at 128 px; rotation-invariant).
SHAPE_MOMENTS = {"square": (0.0, 0.0, 0.28), "circle": (0.0, 0.0, 0.0), "triangle": (0.0, 0.55, 0.0),
                 "bar": (0.83, 0.0, 0.52)}
#: Each shape's rotational symmetry (the moment whose angle tracks its turn); a circle has none.
_SYMMETRY = {"square": 4, "triangle": 3, "bar": 2}

PRESENT_FRACTION = 0.75  # of the frames must show the colour
MIN_DOMINANCE = 0.8  # of a frame's colour pixels must lie in its largest region for it to show one shape
MIN_MOVE = 0.15  # of the frame, along the named direction
MAX_ACROSS = 0.5  # of the move along it, across the direction
MIN_GROWTH = 1.8  # area ratio, last over first (its inverse for shrinking)
MAX_DRIFT = 0.15  # of the frame: how far a growing, shrinking or spinning shape's centre may move
MIN_TURN = 40.0  # degrees


@dataclass
class Verdict:
    """What :func:`check_clip` found: ``colour``, ``shape`` and ``motion`` checks, ``passed`` (all
    three), and the measurements behind them (``details``) and a one-line ``reason`` when failed."""

    colour: bool
    shape: bool
    motion: bool
    details: dict = field(default_factory=dict)
    reason: str = ""

    @property
    def passed(self) -> bool:
        return self.colour and self.shape and self.motion

    def as_dict(self) -> dict:
        return {"passed": self.passed, "colour": self.colour, "shape": self.shape, "motion": self.motion,
                "reason": self.reason, **self.details}


def _as_frames(frames) -> torch.Tensor:
    """(T, H, W, 3) float32 in [0, 1] from uint8 or float frames (numpy or torch); NaN where a float
    frame holds NaN or an infinity (:func:`check_clip` fails such a clip and says why)."""
    x = torch.as_tensor(frames).detach()
    if x.dim() != 4 or x.shape[-1] != 3:
        raise ValueError(f"frames must be (frames, height, width, 3) RGB, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"frames: an empty clip (shape {tuple(x.shape)})")
    if x.dtype == torch.uint8:
        return x.float() / 255.0
    if not x.is_floating_point():
        raise TypeError(f"frames must be uint8 or float in [0, 1], got {x.dtype}")
    x = x.float()
    finite = torch.isfinite(x)
    values = x[finite]
    if values.numel():
        lo, hi = float(values.min()), float(values.max())
        if lo < -0.01 or hi > 1.01:
            raise ValueError(f"float frames must lie in [0, 1], got values in [{lo:.3g}, {hi:.3g}]")
    return torch.where(finite, x.clamp(0, 1), torch.full_like(x, math.nan))


def colour_mask(frames, colour: str) -> torch.Tensor:
    """(T, H, W) bool: the pixels of ``colour`` (a :data:`~fp4video.testmodel.scenes.COLOURS` name)
    after a 3×3 opening."""
    x = _as_frames(frames)
    top, bottom = x.amax(-1), x.amin(-1)
    chroma = top - bottom
    sat = torch.where(top > 0, chroma / top.clamp_min(1e-6), torch.zeros_like(top))
    if colour == "white":
        raw = (sat <= WHITE_MAX_SATURATION) & (top >= WHITE_MIN_VALUE)
    elif colour in HUES:
        r, g, b = x.unbind(-1)
        c = chroma.clamp_min(1e-6)
        hue = torch.where(top == r, ((g - b) / c) % 6, torch.where(top == g, (b - r) / c + 2, (r - g) / c + 4)) * 60
        centre, width = HUES[colour]
        off = (hue - centre + 180) % 360 - 180
        raw = (off.abs() <= width) & (sat >= MIN_SATURATION) & (top >= MIN_VALUE) & (chroma > 0)
    else:
        raise ValueError(f"unknown colour {colour!r}; known: white, {', '.join(HUES)}")
    m = raw.float()[:, None]
    opened = -torch.nn.functional.max_pool2d(-m, 3, stride=1, padding=1)  # erosion
    opened = torch.nn.functional.max_pool2d(opened, 3, stride=1, padding=1)  # dilation
    return opened[:, 0] > 0.5


def largest_region(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For (T, H, W) bool masks: (T, H, W) bool, each frame's largest 8-connected region (among
    regions of one size, the one reaching furthest in raster order; empty where the frame is), and
    (T,) the share of the frame's mask pixels it holds (0 where the frame is empty)."""
    t_count, h, w = mask.shape
    region = torch.zeros_like(mask, dtype=torch.bool)
    share = torch.zeros(t_count)
    rows, cols = mask.any(0).any(1).nonzero().flatten(), mask.any(0).any(0).nonzero().flatten()
    if not len(rows):
        return region, share
    r0, r1, c0, c1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
    box = mask[:, r0:r1, c0:c1]  # the rows and columns any frame's mask reaches
    bh, bw = box.shape[1:]
    # each pixel's label starts as its own index (1-based) in its frame; a region's pixels take the
    # region's largest index: one 8-neighbour step a pass, then a jump to the label of the pixel a
    # label names (that pixel is in the same region and its label is at least as large)
    inside = box.reshape(t_count, -1)
    labels = torch.where(inside, torch.arange(1, bh * bw + 1).expand(t_count, -1), 0)
    while True:
        spread = torch.nn.functional.max_pool2d(labels.reshape(t_count, 1, bh, bw).double(), 3, stride=1, padding=1)
        spread = torch.where(inside, spread.reshape(t_count, -1).long(), 0)
        spread = torch.where(inside, spread.gather(1, (spread - 1).clamp_min(0)), 0)
        if torch.equal(spread, labels):
            break
        labels = spread
    counts = torch.zeros(t_count, bh * bw + 1, dtype=torch.long).scatter_add_(1, labels, torch.ones_like(labels))
    counts[:, 0] = 0  # outside the mask
    best = counts.flip(1).argmax(1)  # the largest region (the largest label among equals), counted from the end
    best = bh * bw - best
    region[:, r0:r1, c0:c1] = ((labels == best[:, None]) & (best[:, None] > 0)).reshape(t_count, bh, bw)
    total = counts.sum(1)
    share = torch.where(total > 0, counts.amax(1).double() / total.clamp_min(1), 0.0).float()
    return region, share


def shape_moments(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For (T, H, W) masks: centroids (T, 2) in pixels (x, y), areas (T,), and the complex moments
    Σ ρ² e^{ikφ} / Σ ρ² about the centroid for k = 2, 3, 4 (T, 3) (complex; NaN where empty)."""
    t_count = mask.shape[0]
    t, y, x = mask.nonzero(as_tuple=True)
    x, y = x.double() + 0.5, y.double() + 0.5

    def per_frame(w):
        return torch.bincount(t, weights=w, minlength=t_count).double()

    area = torch.bincount(t, minlength=t_count).double()
    safe = area.clamp_min(1)
    cx, cy = per_frame(x) / safe, per_frame(y) / safe
    dx, dy = x - cx[t], y - cy[t]
    r2 = dx * dx + dy * dy
    phi = torch.atan2(dy, dx)
    norm = per_frame(r2)
    moments = torch.stack([torch.complex(per_frame(r2 * torch.cos(k * phi)), per_frame(r2 * torch.sin(k * phi))) / norm
                           for k in (2, 3, 4)], -1)
    moments[area == 0] = complex(math.nan, math.nan)
    return torch.stack([cx, cy], -1).float(), area.float(), moments.to(torch.complex64)


def _line_slope(t: torch.Tensor, v: torch.Tensor) -> float:
    """Least-squares slope of v against t."""
    tc = t - t.mean()
    return float((tc * (v - v.mean())).sum() / (tc * tc).sum())


def check_clip(frames, spec: SceneSpec) -> Verdict:
    """Check a clip (frames (T, H, W, 3), uint8 or float in [0, 1]) against its caption's ``spec``."""
    if not isinstance(spec, SceneSpec):
        raise TypeError(f"spec must be a SceneSpec, got {type(spec).__name__}")
    x = _as_frames(frames)
    t_all, h, w = x.shape[:3]
    if t_all < 3:
        raise ValueError(f"a clip needs at least 3 frames to show motion, got {t_all}")
    broken = int(torch.isnan(x).sum())
    if broken:  # a clip with NaN or infinite values shows nothing reliably: it fails, and says why
        return Verdict(False, False, False, {"non_finite_values": broken},
                       f"the clip holds {broken} NaN or infinite values (of {x.numel()})")
    short = min(h, w)
    mask, share = largest_region(colour_mask(x, spec.colour))
    centroid, area, moments = shape_moments(mask)
    # a region of a shape's size: from a quarter of the smallest shape to twice the largest
    smallest = (SIZE_RANGE[0] * SCALE_RANGE[0] * short) ** 2
    largest = (SIZE_RANGE[1] * SCALE_RANGE[1] * short) ** 2
    present = (area >= 0.25 * smallest) & (area <= 2 * largest) & (share >= MIN_DOMINANCE)
    frac = float(present.float().mean())
    details = {"present_fraction": round(frac, 3), "largest_share": round(float(share.median()), 3)}
    colour_ok = frac >= PRESENT_FRACTION
    if int(present.sum()) < 3:
        return Verdict(False, False, False, details, f"the {spec.colour} region is in {int(present.sum())} of "
                                                     f"{t_all} frames")

    idx = present.nonzero().flatten()
    mags = moments[idx].abs()  # (n, 3)
    names = list(SHAPE_MOMENTS)
    protos = torch.tensor([SHAPE_MOMENTS[n] for n in names])
    nearest = torch.cdist(mags, protos).argmin(1)
    votes = {n: int((nearest == i).sum()) for i, n in enumerate(names)}
    most = max(votes.values())
    leaders = [n for n in names if votes[n] == most]
    winner = leaders[0] if len(leaders) == 1 else " or ".join(leaders)
    shape_ok = leaders == [spec.shape]
    details["shape_votes"] = votes
    details["shape_drawn"] = leaders[0] if len(leaders) == 1 else None

    t = idx.float()
    span = float(t_all - 1)
    move = (_line_slope(t, centroid[idx, 0] / w) * span, _line_slope(t, centroid[idx, 1] / h) * span)
    details["move"] = [round(move[0], 4), round(move[1], 4)]
    log_area = torch.log(area[idx])
    growth = math.exp(_line_slope(t, log_area) * span)
    details["area_ratio"] = round(growth, 3)
    drift = math.hypot(*move)
    motion = spec.motion
    if motion in DIRECTIONS:
        axis, sign = {"moves left": (0, -1), "moves right": (0, 1), "moves up": (1, -1), "moves down": (1, 1)}[motion]
        along, across = sign * move[axis], abs(move[1 - axis])
        motion_ok = along >= MIN_MOVE and across <= MAX_ACROSS * along
        why = f"moved {along:+.2f} along, {across:.2f} across (frame fractions)"
    elif motion in ("grows", "shrinks"):
        ratio = growth if motion == "grows" else 1 / growth
        motion_ok = ratio >= MIN_GROWTH and drift <= MAX_DRIFT
        why = f"area ×{growth:.2f}, centre moved {drift:.2f}"
    else:  # spins
        turn = 0.0
        if spec.shape in _SYMMETRY:
            k = _SYMMETRY[spec.shape]
            angle = torch.angle(moments[idx, k - 2]) / k  # the orientation, modulo 2π / k
            period = 2 * math.pi / k
            steps = torch.diff(angle)
            steps = (steps + period / 2) % period - period / 2  # unwrap
            turn = math.degrees(abs(float(_line_slope(t, torch.cat([angle[:1], angle[:1] + steps.cumsum(0)])))
                                    * span))
        details["turn_degrees"] = round(turn, 1)
        motion_ok = drift <= MAX_DRIFT and (spec.shape not in _SYMMETRY or turn >= MIN_TURN)
        why = f"turned {turn:.0f}°, centre moved {drift:.2f}"
    reasons = []
    if not colour_ok:
        reasons.append(f"the {spec.colour} region is in {frac:.0%} of the frames")
    if not shape_ok:
        reasons.append(f"looks like a {winner} ({votes})")
    if not motion_ok:
        reasons.append(f"{motion}: {why}")
    return Verdict(colour_ok, shape_ok, motion_ok, details, "; ".join(reasons))


def check_rate(clips, specs) -> dict:
    """Check each clip against its spec: {"rate": passed / clips, "colour" / "shape" / "motion":
    each check's rate, "by_shape": per captioned shape its clips, its shape check's rate and what
    was drawn ({shape that won the frames, or "none" where no shape won: count}), "verdicts":
    [Verdict.as_dict() per clip]}."""
    if isinstance(specs, SceneSpec):
        raise TypeError("check_rate: specs must be a sequence of SceneSpec, one per clip, got a single SceneSpec "
                        "(check_clip checks one clip)")
    if getattr(clips, "ndim", None) == 4:
        raise TypeError(f"check_rate: clips must be a sequence of clips or a (clips, frames, height, width, 3) "
                        f"batch, got one clip of shape {tuple(clips.shape)} (check_clip checks one clip)")
    clips, specs = list(clips), list(specs)
    if len(clips) != len(specs):
        raise ValueError(f"check_rate: {len(clips)} clips but {len(specs)} specs")
    if not clips:
        raise ValueError("check_rate: no clips (a rate needs at least one)")
    verdicts = [check_clip(c, s) for c, s in zip(clips, specs)]
    n = max(len(verdicts), 1)
    by_shape = {}
    for shape in SHAPES:
        mine = [v for v, s in zip(verdicts, specs) if s.shape == shape]
        if mine:
            drawn = Counter(v.details.get("shape_drawn") or "none" for v in mine)
            by_shape[shape] = {"clips": len(mine), "shape": sum(v.shape for v in mine) / len(mine),
                               "drawn": dict(drawn.most_common())}
    return {"rate": sum(v.passed for v in verdicts) / n, "colour": sum(v.colour for v in verdicts) / n,
            "shape": sum(v.shape for v in verdicts) / n, "motion": sum(v.motion for v in verdicts) / n,
            "clips": len(verdicts), "by_shape": by_shape, "verdicts": [v.as_dict() for v in verdicts]}


def describe_shapes(rate: dict) -> str:
    """One line of :func:`check_rate`'s ``by_shape``: "square 1/6 (circle 4, square 1, bar 1), ..."."""
    return ", ".join(f"{shape} {round(row['shape'] * row['clips'])}/{row['clips']} ("
                     + ", ".join(f"{k} {c}" for k, c in row["drawn"].items()) + ")"
                     for shape, row in rate["by_shape"].items())
