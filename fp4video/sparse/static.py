"""The static selection: a spatio-temporal window on the latent grid, the same for every call."""

from __future__ import annotations

import torch

from .dynamic import always_kept
from .estimate import tile_sums
from .selection import KEY_TILE, QUERY_TILE, BlockSelection, n_tiles, positive_int

__all__ = ["static_selection", "static_token_window", "check_grid"]


def check_grid(frames, height, width, window, text_tokens, text_position, radial):
    for name, v in (("frames", frames), ("height", height), ("width", width)):
        positive_int(v, name)
    try:
        w = tuple(window)
    except TypeError:
        w = ()
    if len(w) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in w):
        raise ValueError(f"window must be three ints >= 0 (frames, rows, columns either side), got {window!r}")
    if isinstance(text_tokens, bool) or not isinstance(text_tokens, int) or text_tokens < 0:
        raise ValueError(f"text_tokens must be an int >= 0, got {text_tokens!r}")
    if text_position not in ("first", "last"):
        raise ValueError(f"text_position must be 'first' or 'last', got {text_position!r}")
    if not isinstance(radial, bool):
        raise ValueError(f"radial must be a bool, got {radial!r}")
    return w


def _spatial_radius(radius: int, distance: int, radial: bool) -> int:
    """The spatial half-width at a frame distance: halved each time the distance doubles (radial)."""
    return radius >> max(distance, 1).bit_length() - 1 if radial else radius


def static_selection(frames: int, height: int, width: int, *, window=(1, 8, 8), text_tokens: int = 0,
                     text_position: str = "first", radial: bool = False, query_tile: int = QUERY_TILE,
                     key_tile: int = KEY_TILE, device=None, query_tiles_at_once: int = 64) -> BlockSelection:
    """The static selection of self-attention over a latent video of ``frames`` × ``height`` ×
    ``width`` tokens flattened frame-major (token ``(f·height + y)·width + x``), with
    ``text_tokens`` more ``text_position`` ``"first"`` or ``"last"`` (joint attention). (1, 1, nq, nk).

    Video token (f, y, x) sees video token (f', y', x') when ``|f − f'| <= window[0]``, ``|y − y'|
    <= r_y`` and ``|x − x'| <= r_x`` with ``(r_y, r_x) = window[1:]``, or with ``radial`` those halved
    each time the frame distance d doubles (``r >> floor(log2 d)`` for d >= 1, Radial Attention's
    energy decay); text tokens see and are seen by every token (:func:`static_token_window` is this
    per token). A query tile visits a key tile when one of its tokens sees one of the key tile's.
    ``query_tiles_at_once`` bounds the memory (that many × frames·height·width values).
    """
    w = check_grid(frames, height, width, window, text_tokens, text_position, radial)
    query_tile, key_tile = positive_int(query_tile, "query_tile"), positive_int(key_tile, "key_tile")
    positive_int(query_tiles_at_once, "query_tiles_at_once")
    video = frames * height * width
    n = video + text_tokens
    nq, nk = n_tiles(n, query_tile), n_tiles(n, key_tile)
    first = text_position == "first"
    offset = text_tokens if first else 0
    pos = torch.arange(video, device=device) + offset
    q_tile = (pos // query_tile).reshape(frames, height, width)
    tiles = torch.zeros(nq, nk, dtype=torch.bool, device=device)
    wf = min(w[0], frames - 1)
    for i0 in range(0, nq, query_tiles_at_once):
        ids = torch.arange(i0, min(i0 + query_tiles_at_once, nq), device=device)
        occ = (q_tile == ids[:, None, None, None]).float()  # (n, F, H, W): the tiles' own video tokens
        reach = torch.zeros_like(occ)
        for dist in range(wf + 1):
            ry = min(_spatial_radius(w[1], dist, radial), height - 1)
            rx = min(_spatial_radius(w[2], dist, radial), width - 1)
            grown = torch.nn.functional.max_pool2d(occ.reshape(-1, 1, height, width), (2 * ry + 1, 2 * rx + 1),
                                                   stride=1, padding=(ry, rx)).reshape(occ.shape)
            if dist == 0:
                reach = torch.maximum(reach, grown)
            else:  # key frame f' = f ± dist
                reach[:, dist:] = torch.maximum(reach[:, dist:], grown[:, :-dist])
                reach[:, :-dist] = torch.maximum(reach[:, :-dist], grown[:, dist:])
        keys = torch.nn.functional.pad(reach.reshape(len(ids), -1), (offset, n - video - offset))  # (n_ids, n)
        tiles[i0 : i0 + len(ids)] = tile_sums(keys, -1, key_tile) > 0
    if text_tokens:  # text rows and columns: every tile holding a text token
        text = (0, text_tokens) if first else (video, n)
        tiles |= always_kept(n, n, query_tile, key_tile, None, (text,), 0, device)[0, 0]
    return BlockSelection(tiles[None, None], n, n, query_tile, key_tile)


def static_token_window(frames: int, height: int, width: int, *, window=(1, 8, 8), text_tokens: int = 0,
                        text_position: str = "first", radial: bool = False, device=None) -> torch.Tensor:
    """(n, n) bool, the window of :func:`static_selection` token by token (True = the query token
    sees the key token): for tests and small grids (n² values)."""
    w = check_grid(frames, height, width, window, text_tokens, text_position, radial)
    video = frames * height * width
    n = video + text_tokens
    idx = torch.arange(video, device=device)
    f, y, x = idx // (height * width), idx // width % height, idx % width
    df = (f[:, None] - f[None, :]).abs()
    band = sum((df >= 2**e).long() for e in range(1, max(frames, 2).bit_length()))  # floor(log2 d), d >= 1
    ry = torch.as_tensor(w[1], device=device) >> band if radial else w[1]
    rx = torch.as_tensor(w[2], device=device) >> band if radial else w[2]
    sees = (df <= w[0]) & ((y[:, None] - y[None, :]).abs() <= ry) & ((x[:, None] - x[None, :]).abs() <= rx)
    out = torch.ones(n, n, dtype=torch.bool, device=device)
    lo = text_tokens if text_position == "first" else 0
    out[lo : lo + video, lo : lo + video] = sees
    return out


