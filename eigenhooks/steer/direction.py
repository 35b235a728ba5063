"""Directions to steer toward: a token's direction in the residual stream, or a contrast of prompts.

All return unit float64 vectors in the residual stream (width d_model).

A token's *logit* direction (its unembedding row, with the final norm's scale folded in)
is not the direction that makes the token *likely*: on SmolLM2 the residual along
" Paris"'s row makes '<filename>' the top token, because rows with large norms and a
share of the unembedding's common direction win the softmax. ``token`` therefore
returns, by default, the direction of the final normalised residual that maximises the
token's probability (``objective="probability"``); ``objective="logit"`` gives the row.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from ..models import get_adapter, layer_index
from ..spectra.readout import scaled_unembedding  # noqa: F401  (eh.direction.scaled_unembedding)

log = logging.getLogger(__name__)
OBJECTIVES = ("probability", "logit")


def _unit(v: torch.Tensor, what: str) -> torch.Tensor:
    n = float(torch.linalg.vector_norm(v))
    if not n > 0 or not torch.isfinite(v).all():
        raise ValueError(f"{what} gives a zero or non-finite direction")
    return v / n


def token_id(tokenizer, text: str) -> int:
    """The (first) token id of ``text``; a warning if it is several tokens.

    Raises:
        ValueError: ``text`` encodes to no token.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"{text!r} encodes to no token; pass a non-empty token such as ' Paris'")
    if len(ids) > 1:
        log.warning("%r is %d tokens; using the first, %r", text, len(ids), tokenizer.decode(ids[:1]))
    return int(ids[0])


def probability_direction(W: torch.Tensor, t: int, steps: int = 200, target: float = 0.99) -> torch.Tensor:
    """The unit x maximising softmax(W (sqrt(d) x))[t], by Adam on the sphere.

    The scale sqrt(d) is that of an RMS-normalised residual. Starts from the centred row
    W[t] - mean(W) and stops once p_t >= target; deterministic.

    Args:
        W: (vocab, d) scaled unembedding. t: token id.

    Returns:
        (d,) float64 unit vector.
    """
    d = W.shape[1]
    x = (W[t] - W.mean(0)).clone().requires_grad_(True)  # (d,)
    opt = torch.optim.Adam([x], lr=0.05)
    for _ in range(steps):
        log_p = torch.log_softmax(W @ (x * d**0.5 / x.norm()), -1)[t]
        if float(log_p.detach()) >= math.log(target):
            break
        opt.zero_grad()
        (-log_p).backward()
        opt.step()
    return _unit(x.detach().to(torch.float64), f"token {t}")


def token(model, tokenizer, text: str, objective: str = "probability") -> torch.Tensor:
    """The residual direction toward ``text``'s (first) token.

    Args:
        objective: 'probability' (default): the direction of the normalised final residual
            that makes the token most probable (see ``probability_direction``);
            'logit': the direction that raises its logit most, the unembedding row times
            the final norm's scale.

    Returns:
        (d,) float64 unit vector.

    Raises:
        ValueError: unknown objective, the text is no token, or the model has no unembedding.

    Example:
        >>> u = eh.direction.token(model, tok, " Paris")  # doctest: +SKIP
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    t = token_id(tokenizer, text)
    W = scaled_unembedding(model)
    if not 0 <= t < W.shape[0]:
        raise ValueError(f"token id {t} of {text!r} is outside the unembedding's {W.shape[0]} rows")
    if objective == "logit":  # the row again in float64: W is float32, for the probability objective's speed
        ad = get_adapter(model)
        row, scale = ad.unembedding()[t].detach().to("cpu", torch.float64), ad.final_norm_scale()
        return _unit(row if scale is None else row * scale.to("cpu"), f"token {text!r}")
    with torch.enable_grad():
        return probability_direction(W, t)


def from_npy(path, d: int, tol: float = 1e-3) -> torch.Tensor:
    """A unit direction saved with ``numpy.save``: a (d,) array of real numbers, finite, of norm 1.

    The file is read with ``allow_pickle=False``: a file that is not a plain .npy array is
    refused, never unpickled.

    Args:
        path: the .npy file.
        d: the model's width.
        tol: how far from 1 the norm may be.

    Returns:
        (d,) float64 unit vector.

    Raises:
        ValueError: one line that starts with the path and says what is wrong with the file.

    Example:
        >>> np.save("u.npy", u / np.linalg.norm(u)); eh.direction.from_npy("u.npy", 576)  # doctest: +SKIP
    """
    import numpy as np

    p = Path(path).expanduser()
    how = f"save a unit vector of the model's width with numpy.save(path, u / np.linalg.norm(u)), u of shape ({d},)"
    a = _read_npy(p, how)
    if a.dtype.kind not in "fiu":
        raise ValueError(f"{p} holds {a.dtype} values ({_KINDS.get(a.dtype.kind, 'not numbers')}): {how}")
    if a.shape != (d,):
        raise ValueError(f"{p} holds an array of shape {a.shape}, not a vector of the model's width ({d},): {how}")
    u = torch.from_numpy(np.asarray(a, dtype=np.float64))
    if not torch.isfinite(u).all():
        raise ValueError(f"{p} holds {int((~torch.isfinite(u)).sum())} non-finite entries (NaN or inf): {how}")
    n = float(torch.linalg.vector_norm(u))
    if abs(n - 1) > tol:
        raise ValueError(f"{p} holds a vector of norm {n:.4g}, not a unit vector: {how}")
    return u / n


_KINDS = {"c": "complex numbers", "b": "booleans", "U": "text", "S": "bytes", "O": "Python objects", "V": "records"}


def _read_npy(p: Path, how: str):
    """The array in p, or a ValueError naming p (np.load's own messages advise unpickling)."""
    import zipfile

    import numpy as np

    if not p.exists():
        raise ValueError(f"{p}: no such file")
    if not p.is_file():
        raise ValueError(f"{p} is a folder, not a .npy file")
    if p.stat().st_size == 0:
        raise ValueError(f"{p} is empty: {how}")
    try:
        a = np.load(p, allow_pickle=False)
    except ValueError as e:  # no .npy header (numpy then suspects a pickle), object arrays, a cut body
        if "Object arrays" in str(e):
            raise ValueError(f"{p} holds Python objects, which are only stored pickled and never loaded: {how}") from e
        raise ValueError(f"{p} is not a .npy array file, or is cut short: {how}") from e
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{p} is not a .npy array file, or is cut short ({type(e).__name__}): {how}") from e
    if not isinstance(a, np.ndarray):  # np.load opens a zip as an .npz archive of several arrays
        a.close()
        raise ValueError(f"{p} is an .npz archive, not one .npy array: {how}")
    return a


@torch.no_grad()
def contrast(model, tokenizer, pos_prompts: list[str], neg_prompts: list[str], layer: int = -1) -> torch.Tensor:
    """Mean residual (output of block ``layer``, all real tokens) of pos minus that of neg, unit.

    Raises:
        TypeError: layer not an int. IndexError: layer out of range. ValueError: no prompts on a side.
    """
    ad = get_adapter(model)
    block = ad.layers[layer_index(layer, ad.n_layers)].block

    def mean_residual(prompts):
        total, count = None, 0
        for p in prompts:
            got = {}
            h = block.register_forward_hook(lambda m, a, o: got.__setitem__("x", o[0] if isinstance(o, tuple) else o))
            try:
                enc = tokenizer(p, return_tensors="pt")
                dev = next(model.parameters()).device
                model(**{k: v.to(dev) for k, v in enc.items()})
            finally:
                h.remove()
            x = got["x"][0].to("cpu", torch.float64)  # (n, d)
            total = x.sum(0) if total is None else total + x.sum(0)
            count += x.shape[0]
        return total / count

    if not pos_prompts or not neg_prompts:
        raise ValueError("contrast needs at least one positive and one negative prompt")
    return _unit(mean_residual(pos_prompts) - mean_residual(neg_prompts), "contrast")


def lm_head_looks_random(model) -> bool:
    """Whether the LM head looks freshly initialised (untrained) rather than trained.

    A matrix of i.i.d. entries (vocab V x d, q = d / V < 1) has all its singular values in
    the Marchenko-Pastur band sigma sqrt(V) (1 ± sqrt(q)), so its condition number is near
    (1 + sqrt(q)) / (1 - sqrt(q)); trained unembeddings are far more anisotropic (a common
    direction, frequency structure). The head counts as random when its condition number
    is within 1.5x of that bound. A model without a head returns False.
    """
    W = get_adapter(model).unembedding()  # raw: a trained final norm's scale must not hide a random head
    if W is None or W.dim() != 2:
        return False
    W = W.detach().to("cpu", torch.float64)
    V, d = W.shape
    if V <= d:
        return False
    s = torch.linalg.svdvals(W)
    if not float(s[-1]) > 0:
        return False
    q = (d / V) ** 0.5
    return float(s[0] / s[-1]) < 1.5 * (1 + q) / (1 - q)
