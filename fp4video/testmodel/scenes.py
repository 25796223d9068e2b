"""Synthetic text-to-video scenes: a shape in a named colour moving, growing, shrinking or spinning
over a natural image, a texture or a plain background, with the camera still, panning or zooming,
and the caption that names them ("a red square moves left over the astronaut photo as the camera
zooms in").

A scene is a :class:`SceneSpec` (what the caption names) plus continuous parameters the caption
does not name (size, start position, distance, orientation, the camera's start window, texture
colours), all drawn from a seeded CPU generator, so the same seed gives the same scenes on any
device. :func:`render` draws a batch of scenes on any device (the GPU in training): every pixel of
every frame from closed-form shape distances and one ``grid_sample`` of the background images,
with no per-clip Python loop.

Backgrounds are dimmed and desaturated (saturation ≤ 0.35, value ≤ 0.65) and the shapes are pure
saturated colours or white, so a colour name picks out the shape alone (what the motion checker
relies on). The natural images are scikit-image's sample images (``skimage.data``, shipped inside
the package, read offline).

:data:`HELD_OUT` is the fixed set of (colour, shape, motion, background) combinations training
never shows; :func:`sample_scenes` leaves them out unless asked for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

__all__ = ["COLOURS", "SHAPES", "MOTIONS", "DIRECTIONS", "BACKGROUNDS", "CAMERAS", "SceneSpec", "Scenes", "HELD_OUT",
           "caption", "parse_caption", "vocabulary", "sample_scenes", "sampling_probabilities", "render", "held_out_scenes", "background_bank",
           "SHAPE_AREA", "SIZE_RANGE", "SCALE_RANGE", "DISTANCE_RANGE", "SPIN_RANGE"]

#: Named shape colours (RGB in [0, 1]): fully saturated hues and white.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0), "orange": (1.0, 0.5, 0.0), "yellow": (1.0, 1.0, 0.0), "green": (0.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0), "blue": (0.0, 0.0, 1.0), "magenta": (1.0, 0.0, 1.0), "white": (1.0, 1.0, 1.0),
}
SHAPES = ("square", "circle", "triangle", "bar")
#: The moves are in screen coordinates (the camera moves the background only).
DIRECTIONS = ("moves left", "moves right", "moves up", "moves down")
MOTIONS = (*DIRECTIONS, "grows", "shrinks", "spins")
CAMERAS = ("still", "pans left", "pans right", "zooms in", "zooms out")

#: name -> (kind, the caption's words, source). Kinds: ``image`` (a skimage.data sample image, the
#: source its function name), ``stripes`` / ``checks`` (drawn), ``plain`` (the source its grey level).
BACKGROUNDS: dict[str, tuple[str, str, object]] = {
    "astronaut": ("image", "over the astronaut photo", "astronaut"),
    "coffee": ("image", "over the coffee photo", "coffee"),
    "cat": ("image", "over the cat photo", "chelsea"),
    "rocket": ("image", "over the rocket photo", "rocket"),
    "galaxy": ("image", "over the galaxy photo", "hubble_deep_field"),
    "cells": ("image", "over the cells photo", "immunohistochemistry"),
    "cameraman": ("image", "over the cameraman photo", "camera"),
    "coins": ("image", "over the coins photo", "coins"),
    "brick": ("image", "over the brick wall", "brick"),
    "grass": ("image", "over the grass", "grass"),
    "gravel": ("image", "over the gravel", "gravel"),
    "striped": ("stripes", "on a striped background", None),
    "checkered": ("checks", "on a checkered background", None),
    "black": ("plain", "on a black background", 0.04),
    "grey": ("plain", "on a grey background", 0.42),
}
_IMAGES = [k for k, v in BACKGROUNDS.items() if v[0] == "image"]
_KIND_CODE = {"image": 0, "stripes": 1, "checks": 2, "plain": 3}

#: Shapes in units of the scene's size ``s`` (a square's side); the four have about the same area.
#: circle: diameter 1.15; triangle: equilateral, side 1.5, pointing up; bar: 1.8 × 0.55.
SHAPE_AREA = {"square": 1.0, "circle": math.pi * 0.575 ** 2, "triangle": math.sqrt(3) / 4 * 1.5 ** 2,
              "bar": 1.8 * 0.55}
#: The size ``s`` as a fraction of the frame's shorter side.
SIZE_RANGE = (0.17, 0.23)
#: A growing shape's scale goes from the first to the second (a shrinking one the other way).
SCALE_RANGE = (0.65, 1.35)
#: A move's length as a fraction of the frame's width (left / right) or height (up / down).
DISTANCE_RANGE = (0.35, 0.5)
#: A spin's total turn in radians (either way).
SPIN_RANGE = (math.pi / 2, 5 * math.pi / 6)
#: How far from its centre a shape reaches, in units of ``s`` (the bar's half length and a margin).
_REACH = 0.95

#: Background dimming: value v -> _V0 + _V1 * v, saturation times _SAT (at most 0.65 and 0.35).
_V0, _V1, _SAT = 0.08, 0.57, 0.35
#: The camera's window: half of the background image's extent it shows (normalized coordinates).
_WINDOW = 2 / 3
_PAN = 0.2  # how far a pan moves the window's centre each way (normalized coordinates)
_ZOOM = 0.7  # a zoom-in ends with the window this much smaller (a zoom-out starts there)
_BANK_SIZE = 192  # pixels of each background image in the bank (square)


class SceneSpec(BaseModel):
    """What a caption names: a shape's colour, the shape, its motion, the background, the camera."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    colour: Literal["red", "orange", "yellow", "green", "cyan", "blue", "magenta", "white"]
    shape: Literal["square", "circle", "triangle", "bar"]
    motion: Literal["moves left", "moves right", "moves up", "moves down", "grows", "shrinks", "spins"]
    background: Literal["astronaut", "coffee", "cat", "rocket", "galaxy", "cells", "cameraman", "coins", "brick",
                        "grass", "gravel", "striped", "checkered", "black", "grey"]
    camera: Literal["still", "pans left", "pans right", "zooms in", "zooms out"] = "still"

    def model_post_init(self, _context) -> None:
        if self.camera != "still" and BACKGROUNDS[self.background][0] == "plain":
            raise ValueError(f"a {self.background} background shows no camera motion: its camera is still, "
                             f"got {self.camera!r}")

    @property
    def combination(self) -> tuple[str, str, str, str]:
        """(colour, shape, motion, background): what :data:`HELD_OUT` holds out."""
        return (self.colour, self.shape, self.motion, self.background)

    @property
    def caption(self) -> str:
        return caption(self)


def caption(spec: SceneSpec) -> str:
    """The scene's caption, e.g. "a red square moves left over the astronaut photo as the camera pans right";
    "an orange ..." before a vowel)."""
    article = "an" if spec.colour[0] in "aeiou" else "a"
    text = f"{article} {spec.colour} {spec.shape} {spec.motion} {BACKGROUNDS[spec.background][1]}"
    return text if spec.camera == "still" else f"{text} as the camera {spec.camera}"


def parse_caption(text: str) -> SceneSpec | None:
    """The scene a caption names (:func:`caption`'s inverse; case, surrounding spaces and a final
    full stop aside), or None where the text is not such a caption."""
    if not isinstance(text, str):
        raise TypeError(f"parse_caption: text must be a str, got {type(text).__name__}")
    words = " ".join(text.strip().rstrip(".").lower().split())
    camera = "still"
    for c in CAMERAS[1:]:
        if words.endswith(f" as the camera {c}"):
            words, camera = words[: -len(f" as the camera {c}")], c
            break
    parts = words.split(" ", 3)
    if len(parts) < 4:
        return None
    article, colour, shape, rest = parts
    motion = next((m for m in MOTIONS if rest.startswith(m + " ")), None)
    background = next((b for b, v in BACKGROUNDS.items() if motion and rest == f"{motion} {v[1]}"), None)
    if colour not in COLOURS or shape not in SHAPES or background is None:
        return None
    try:
        spec = SceneSpec(colour=colour, shape=shape, motion=motion, background=background, camera=camera)
    except ValueError:
        return None
    return spec if caption(spec) == " ".join([article, colour, shape, rest] + (
        [f"as the camera {camera}"] if camera != "still" else [])) else None


def vocabulary() -> list[str]:
    """Every word a caption can hold, sorted (the text encoder's word-level vocabulary)."""
    words = {"a", "an", "as", "the", "camera"} | set(COLOURS) | set(SHAPES)
    for phrase in (*MOTIONS, *CAMERAS[1:], *(v[1] for v in BACKGROUNDS.values())):
        words |= set(phrase.split())
    return sorted(words)


def _held_out() -> tuple[SceneSpec, ...]:
    # 24 combinations: every colour three times, every shape six times, each checkable motion (the four
    # directions, grows, shrinks) four times, backgrounds stepping through all fifteen; camera still
    backgrounds = list(BACKGROUNDS)
    out = []
    for i in range(24):
        out.append(SceneSpec(colour=list(COLOURS)[i % 8], shape=SHAPES[(i // 2) % 4], motion=MOTIONS[i % 6],
                             background=backgrounds[(7 * i) % 15]))
    return tuple(out)


#: Combinations of (colour, shape, motion, background) that training never shows, with any camera.
HELD_OUT: tuple[SceneSpec, ...] = _held_out()


@dataclass
class Scenes:
    """A batch of scenes: ``specs`` (what the captions name) and ``params`` ({name: tensor with one
    row per scene}, CPU, positions and sizes as fractions of the frame)."""

    specs: list[SceneSpec]
    params: dict[str, torch.Tensor]

    def __len__(self) -> int:
        return len(self.specs)

    def captions(self) -> list[str]:
        return [s.caption for s in self.specs]

    def subset(self, index) -> "Scenes":
        index = torch.as_tensor(index, dtype=torch.long)
        return Scenes([self.specs[i] for i in index.tolist()], {k: v[index] for k, v in self.params.items()})


def _uniform(g: torch.Generator, n: int, lo: float, hi: float) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)


def _pick(g: torch.Generator, n: int, k: int) -> list[int]:
    return torch.randint(k, (n,), generator=g).tolist()


def sampling_probabilities(weights, names, what: str) -> torch.Tensor | None:
    """The probabilities (float64, in ``names``' order) of drawing each of ``names`` given relative
    ``weights`` ({name: weight ≥ 0}, names left out weigh 1), or None where the draw is uniform (no
    weights, or all equal: the uniform draw itself, so those give the same scenes as no weights).
    ``what`` names the weights in the error raised for unknown names or bad values."""
    if weights is None:
        return None
    if not isinstance(weights, dict):
        raise TypeError(f"{what}: a mapping {{name: weight}}, got a {type(weights).__name__}")
    names = tuple(names)
    unknown = sorted(str(k) for k in weights if k not in names)
    if unknown:
        raise ValueError(f"{what}: unknown name {unknown[0]!r} (one of {', '.join(names)})")
    for k, v in weights.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{what}: the weight of {k} must be a finite number ≥ 0, got {v!r}")
    w = torch.tensor([float(weights.get(k, 1.0)) for k in names], dtype=torch.float64)
    if not (w > 0).any():
        raise ValueError(f"{what}: every weight is 0 (at least one must be positive)")
    if (w == w[0]).all():
        return None
    return w / w.sum()


def _draw(g: torch.Generator, n: int, k: int, p: torch.Tensor | None) -> list[int]:
    """``n`` indices below ``k``: uniform (:func:`_pick`) where ``p`` is None, else drawn with
    probabilities ``p``."""
    if p is None:
        return _pick(g, n, k)
    return torch.multinomial(p, n, replacement=True, generator=g).tolist()


def _random_specs(g: torch.Generator, n: int, exclude: set, shape_p: torch.Tensor | None = None,
                  colour_p: torch.Tensor | None = None) -> list[SceneSpec]:
    """``n`` scene specs (the camera still half the time), none of whose combinations is in
    ``exclude`` (those are drawn again); the shape and the colour drawn with probabilities
    ``shape_p`` / ``colour_p`` (:func:`sampling_probabilities`; None: uniformly), the rest uniformly."""
    colours, backgrounds = list(COLOURS), list(BACKGROUNDS)
    out: list[SceneSpec | None] = [None] * n
    todo = list(range(n))
    while todo:
        m = len(todo)
        c, s, mo, b, cam = (_draw(g, m, k, p) for k, p in ((len(colours), colour_p), (len(SHAPES), shape_p),
                                                            (len(MOTIONS), None), (len(backgrounds), None), (8, None)))
        again = []
        for j, i in enumerate(todo):
            combo = (colours[c[j]], SHAPES[s[j]], MOTIONS[mo[j]], backgrounds[b[j]])
            if combo in exclude:
                again.append(i)
                continue
            camera = "still" if cam[j] >= 4 or BACKGROUNDS[combo[3]][0] == "plain" else CAMERAS[1 + cam[j]]
            out[i] = SceneSpec(colour=combo[0], shape=combo[1], motion=combo[2], background=combo[3], camera=camera)
        todo = again
    return out


def _dull_colours(g: torch.Generator, n: int) -> torch.Tensor:
    """(n, 2, 3) random colours, dimmed and desaturated like the background images."""
    return _dim(torch.rand(n, 2, 3, generator=g, dtype=torch.float64), dim=-1)


def _dim(rgb: torch.Tensor, dim: int) -> torch.Tensor:
    """Dim and desaturate RGB in [0, 1] (channels along ``dim``): value v -> 0.08 + 0.57 v,
    saturation × 0.35, hue kept (channel c = V'(1 - S'(1 - c / max)) with S' = 0.35 S)."""
    top = rgb.amax(dim=dim, keepdim=True)
    ratio = torch.where(top > 0, rgb / top.clamp_min(1e-12), torch.ones_like(rgb))
    return (_V0 + _V1 * top) * (1 - _SAT * (1 - ratio))


def sample_scenes(n: int, *, seed: int, specs: list[SceneSpec] | None = None,
                  exclude=tuple(HELD_OUT), shape_weights: dict | None = None,
                  colour_weights: dict | None = None, upright: bool = False) -> Scenes:
    """``n`` scenes from ``seed``: the specs drawn leaving out the combinations of ``exclude``
    (default :data:`HELD_OUT`), or the given ``specs``; the continuous parameters drawn for each.
    The specs' shapes and colours are drawn uniformly, or with the relative ``shape_weights`` /
    ``colour_weights`` ({name: weight}, names left out weigh 1; :func:`sampling_probabilities`);
    the other names uniformly. The same seed and weights give the same scenes on every machine.
    ``upright``: every shape starts at angle 0 (a square's sides and a bar's length along the frame's
    axes, a triangle pointing up; a spin turns from there) instead of a random angle the caption does
    not name; every other parameter is the same draw."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a whole number ≥ 0, got {n!r}")
    if not isinstance(upright, bool):
        raise TypeError(f"upright must be True or False, got {upright!r}")
    shape_p = sampling_probabilities(shape_weights, SHAPES, "shape_weights")
    colour_p = sampling_probabilities(colour_weights, COLOURS, "colour_weights")
    g = torch.Generator().manual_seed(int(seed))
    if specs is None:
        specs = _random_specs(g, n, {s.combination if isinstance(s, SceneSpec) else tuple(s) for s in exclude},
                              shape_p, colour_p)
    else:
        if shape_p is not None or colour_p is not None:
            raise ValueError("sample_scenes: shape_weights / colour_weights draw the specs: give no specs with them")
        specs = list(specs)
        if len(specs) != n:
            raise ValueError(f"sample_scenes: {n} scenes asked for, {len(specs)} specs given")
        bad = [i for i, s in enumerate(specs) if not isinstance(s, SceneSpec)]
        if bad:
            raise TypeError(f"specs[{bad[0]}] is a {type(specs[bad[0]]).__name__}, not a SceneSpec")
    p: dict[str, torch.Tensor] = {}
    p["colour"] = torch.tensor([COLOURS[s.colour] for s in specs], dtype=torch.float64).reshape(n, 3)
    p["shape"] = torch.tensor([SHAPES.index(s.shape) for s in specs], dtype=torch.long)
    kinds = [BACKGROUNDS[s.background][0] for s in specs]
    p["bg_kind"] = torch.tensor([_KIND_CODE[k] for k in kinds], dtype=torch.long)
    p["bg_image"] = torch.tensor([_IMAGES.index(s.background) if k == "image" else 0
                                  for s, k in zip(specs, kinds)], dtype=torch.long)
    p["bg_level"] = torch.tensor([BACKGROUNDS[s.background][2] if k == "plain" else 0.0
                                  for s, k in zip(specs, kinds)], dtype=torch.float64)
    p["tex_colours"] = _dull_colours(g, n)
    p["tex_period"] = _uniform(g, n, 0.15, 0.3)
    p["tex_angle"] = _uniform(g, n, 0.0, math.pi)
    p["flip"] = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)

    size = _uniform(g, n, *SIZE_RANGE)  # of the shorter side
    scale0 = torch.ones(n, dtype=torch.float64)
    scale1 = torch.ones(n, dtype=torch.float64)
    grows = torch.tensor([s.motion == "grows" for s in specs])
    shrinks = torch.tensor([s.motion == "shrinks" for s in specs])
    scale0[grows], scale1[grows] = SCALE_RANGE
    scale0[shrinks], scale1[shrinks] = SCALE_RANGE[1], SCALE_RANGE[0]
    angle0 = _uniform(g, n, 0.0, 2 * math.pi)  # drawn either way, so the later draws do not depend on upright
    if upright:
        angle0 = torch.zeros_like(angle0)
    spin = _uniform(g, n, *SPIN_RANGE) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    spin[torch.tensor([s.motion != "spins" for s in specs], dtype=torch.bool)] = 0.0
    distance = _uniform(g, n, *DISTANCE_RANGE)
    # positions as fractions of the frame; the margin keeps the whole shape inside on a square frame
    # (the renderer scales sizes by the shorter side, so on a wider frame there is more room)
    margin = _REACH * size * torch.maximum(scale0, scale1)
    along_start = margin + (1 - 2 * margin - distance).clamp_min(0) * torch.rand(n, generator=g, dtype=torch.float64)
    pos0 = margin[:, None] + (1 - 2 * margin[:, None]) * torch.rand(n, 2, generator=g, dtype=torch.float64)
    disp = torch.zeros(n, 2, dtype=torch.float64)
    for axis, sign, motion in ((0, -1, "moves left"), (0, 1, "moves right"), (1, -1, "moves up"),
                               (1, 1, "moves down")):
        m = torch.tensor([s.motion == motion for s in specs], dtype=torch.bool)
        # a move left starts at the right: the start is ``along_start`` from the far edge
        pos0[m, axis] = along_start[m] if sign > 0 else 1 - along_start[m]
        disp[m, axis] = sign * distance[m]
    p.update(size=size, scale0=scale0, scale1=scale1, angle0=angle0, spin=spin, pos0=pos0, disp=disp)

    # the camera: its window's centre (normalized image coordinates) and half extent, start and end
    cam_c0 = (1 - _WINDOW - _PAN) * (2 * torch.rand(n, 2, generator=g, dtype=torch.float64) - 1)
    cam_dc = torch.zeros(n, 2, dtype=torch.float64)
    z0, z1 = torch.ones(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
    for i, s in enumerate(specs):
        if s.camera == "pans left":  # the view moves left: the picture slides right
            cam_c0[i, 0] += _PAN
            cam_dc[i, 0] = -2 * _PAN
        elif s.camera == "pans right":
            cam_c0[i, 0] -= _PAN
            cam_dc[i, 0] = 2 * _PAN
        elif s.camera == "zooms in":
            z1[i] = _ZOOM
        elif s.camera == "zooms out":
            z0[i] = _ZOOM
    p.update(cam_c0=cam_c0, cam_dc=cam_dc, cam_z0=z0, cam_z1=z1)
    return Scenes(specs, p)


def held_out_scenes(seed: int = 0, repeats: int = 1, upright: bool = False) -> Scenes:
    """The :data:`HELD_OUT` combinations (camera still), each ``repeats`` times, with parameters from ``seed``
    (shapes at angle 0 where ``upright``)."""
    specs = [s for s in HELD_OUT for _ in range(repeats)]
    return sample_scenes(len(specs), seed=seed, specs=specs, upright=upright)


_BANKS: dict = {}


def background_bank(device="cpu") -> torch.Tensor:
    """(images, 3, 192, 192) float32: the background images, square-cropped, resized and dimmed
    (kept per device after the first call)."""
    device = torch.device(device)
    if device not in _BANKS:
        if "cpu" in {d.type for d in _BANKS}:
            _BANKS[device] = _BANKS[next(d for d in _BANKS if d.type == "cpu")].to(device)
        else:
            _BANKS[device] = _load_bank().to(device)
    return _BANKS[device]


def _load_bank() -> torch.Tensor:
    try:
        import skimage.data
    except ImportError:
        raise ImportError("the test model's scenes need scikit-image (its skimage.data sample images are the "
                          "backgrounds): pip install scikit-image") from None
    images = []
    for name in _IMAGES:
        x = torch.from_numpy(getattr(skimage.data, BACKGROUNDS[name][2])()).double() / 255.0
        if x.dim() == 2:
            x = x[..., None].expand(*x.shape, 3)
        x = x[..., :3].permute(2, 0, 1)
        h, w = x.shape[1:]
        side = min(h, w)
        x = x[:, (h - side) // 2:(h - side) // 2 + side, (w - side) // 2:(w - side) // 2 + side]
        x = torch.nn.functional.interpolate(x[None], size=(_BANK_SIZE, _BANK_SIZE), mode="bilinear",
                                            antialias=True, align_corners=False)[0].clamp(0, 1)
        images.append(_dim(x, dim=0))
    return torch.stack(images).float()


def _shape_distance(shape: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Signed distance (units of ``s``, negative inside) to each pixel's shape at local coordinates
    (u, v) (v points down the frame); ``shape`` broadcasts against u."""
    square = torch.maximum(u.abs(), v.abs()) - 0.5
    circle = torch.sqrt(u * u + v * v) - 0.575
    r_in = 1.5 / (2 * math.sqrt(3))  # the triangle's inradius
    c, h = math.sqrt(3) / 2, 0.5
    triangle = torch.maximum(v, torch.maximum(c * u - h * v, -c * u - h * v)) - r_in
    bar = torch.maximum(u.abs() - 0.9, v.abs() - 0.275)
    return torch.where(shape == 0, square, torch.where(shape == 1, circle, torch.where(shape == 2, triangle, bar)))


def render(scenes: Scenes, *, frames: int, height: int, width: int, device="cpu", chunk: int = 16):
    """Draw ``scenes``: ``(video, mask)``, video (B, 3, frames, height, width) float32 in [-1, 1]
    (what the VAE takes), mask (B, 1, frames, height, width) the shape's coverage in [0, 1]."""
    for name, v in (("frames", frames), ("height", height), ("width", width), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"render: {name} must be a whole number ≥ 1, got {v!r}")
    device = torch.device(device)
    videos, masks = [], []
    for start in range(0, len(scenes), chunk):
        part = {k: v[start:start + chunk].to(device=device, dtype=torch.float32 if v.is_floating_point() else v.dtype)
                for k, v in scenes.params.items()}
        video, mask = _render_chunk(part, frames, height, width, device)
        videos.append(video)
        masks.append(mask)
    if not videos:
        return (torch.zeros(0, 3, frames, height, width, device=device),
                torch.zeros(0, 1, frames, height, width, device=device))
    return torch.cat(videos), torch.cat(masks)


def _render_chunk(p: dict, frames: int, height: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    b = p["shape"].shape[0]
    f32 = dict(device=device, dtype=torch.float32)
    tau = torch.linspace(0, 1, frames, **f32) if frames > 1 else torch.zeros(1, **f32)
    tau = tau[None, :, None, None]  # (1, T, 1, 1)
    y = (torch.arange(height, **f32) + 0.5)[None, None, :, None]
    x = (torch.arange(width, **f32) + 0.5)[None, None, None, :]
    short = float(min(height, width))

    def per_clip(name):
        return p[name][:, None, None, None]

    # the shape: centre, size and angle per frame; local coordinates of every pixel
    cx = (p["pos0"][:, 0, None, None, None] + tau * p["disp"][:, 0, None, None, None]) * width
    cy = (p["pos0"][:, 1, None, None, None] + tau * p["disp"][:, 1, None, None, None]) * height
    scale = per_clip("size") * short * (per_clip("scale0") + tau * (per_clip("scale1") - per_clip("scale0")))
    angle = per_clip("angle0") + tau * per_clip("spin")
    cos, sin = torch.cos(angle), torch.sin(angle)
    dx, dy = x - cx, y - cy
    u = (cos * dx + sin * dy) / scale
    v = (-sin * dx + cos * dy) / scale
    dist = _shape_distance(per_clip("shape"), u, v) * scale  # pixels
    cover = (0.5 - dist).clamp(0, 1)  # (B, T, H, W): one pixel of anti-aliasing

    # the background: each pixel's point in normalized image coordinates through the camera's window
    half = _WINDOW * (per_clip("cam_z0") + tau * (per_clip("cam_z1") - per_clip("cam_z0")))
    gx = (2 * x / width - 1) * per_clip("flip")
    gy = (2 * y / height - 1) * (height / width)
    sx = p["cam_c0"][:, 0, None, None, None] + tau * p["cam_dc"][:, 0, None, None, None] + half * gx
    sy = p["cam_c0"][:, 1, None, None, None] + tau * p["cam_dc"][:, 1, None, None, None] + half * gy
    sx, sy = torch.broadcast_tensors(sx, sy)
    kind = p["bg_kind"]
    bg = torch.empty(b, frames, height, width, 3, **f32)
    images = (kind == 0).nonzero().flatten()
    if len(images):
        bank = background_bank(device)
        src = bank[p["bg_image"][images]]  # (n, 3, S, S)
        grid = torch.stack([sx[images], sy[images]], -1)  # (n, T, H, W, 2)
        n = len(images)
        src = src[:, None].expand(n, frames, *src.shape[1:]).reshape(n * frames, *src.shape[1:])
        sampled = torch.nn.functional.grid_sample(src, grid.reshape(n * frames, height, width, 2), mode="bilinear",
                                                  padding_mode="reflection", align_corners=False)
        bg[images] = sampled.reshape(n, frames, 3, height, width).permute(0, 1, 3, 4, 2)
    drawn = ((kind == 1) | (kind == 2)).nonzero().flatten()
    if len(drawn):
        period = per_clip("tex_period")[drawn]
        a = per_clip("tex_angle")[drawn]
        px, py = sx[drawn], sy[drawn]
        stripes = torch.sin(2 * math.pi * (px * torch.cos(a) + py * torch.sin(a)) / period)
        checks = torch.sin(2 * math.pi * px / period) * torch.sin(2 * math.pi * py / period)
        wave = torch.where(kind[drawn][:, None, None, None] == 1, stripes, checks)
        mix = (0.5 + 0.5 * torch.tanh(4 * wave))[..., None]  # soft two-colour pattern
        c = p["tex_colours"][drawn]
        bg[drawn] = c[:, 0, None, None, None, :] * (1 - mix) + c[:, 1, None, None, None, :] * mix
    plain = (kind == 3).nonzero().flatten()
    if len(plain):
        bg[plain] = p["bg_level"][plain][:, None, None, None, None].expand(-1, frames, height, width, 3)

    cover4 = cover[..., None]
    rgb = bg * (1 - cover4) + p["colour"][:, None, None, None, :] * cover4
    video = (2 * rgb - 1).permute(0, 4, 1, 2, 3).contiguous()
    return video, cover[:, None]
