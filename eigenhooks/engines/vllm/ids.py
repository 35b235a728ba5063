"""How a vLLM request is named: the engine's own id (the key everything is counted by) and the user's.

vLLM accepts any request id (offline ``add_request(request_id=...)``, the OpenAI server's ``X-Request-Id``
header), duplicates included, and keeps requests apart by an internal id: the user's id, ``-`` and 8
random characters (``InputProcessor.assign_request_id``), a sample of ``n > 1`` ``f"{index}_{internal id
of its parent}"``. ``RequestOutput.request_id`` carries the user's id only. eigenhooks counts each request
by the internal id (the key: unique, so two requests that share the user's id are two sequences) and
names it by three columns: ``request_id`` (the user's), ``sample`` (``CompletionOutput.index``) and
``engine_id`` (the key itself: rows with equal ``request_id`` and ``sample`` but another ``engine_id``
are requests that shared an id). With ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` set the internal id is
the user's: requests sharing an id are then one to vLLM itself, and counted as one (``plugin`` warns once).

Imports nothing.
"""

from __future__ import annotations

import re

_COMPLETION = re.compile(r"^(cmpl-.+)-(\d+)$")  # the completions API's engine id: f"{response id}-{prompt index}"
_SAMPLE = re.compile(r"^(\d+)_(.+)$")  # a sample of n > 1: vLLM's child id f"{index}_{parent id}"
_SUFFIX = re.compile(r"^(.*)-[0-9A-Za-z]{8}$")  # the internal id: f"{user's id}-{8 random characters}"


def user_key(internal: str, randomized: bool = True) -> str:
    """The request id the user sees, from the engine's internal one (``{id}-{8 characters}`` unless vLLM's
    request id randomisation is off). Samples of ``n > 1`` keep their ``{index}_`` prefix."""
    if randomized:
        m = _SUFFIX.match(internal)
        if m:
            return m.group(1)
    return internal


def split_sample(key: str) -> tuple[str, int]:
    """(the request's id, the sample's index) of a request id: vLLM runs each sample of ``n > 1`` as its own
    request ``f"{index}_{request id}"`` (``CompletionOutput.index``); any other id is sample 0.

    A request id of your own of the form ``<digits>_<rest>`` reads as a sample of ``<rest>`` too: vLLM's own
    ids (offline counters, the API's ``cmpl-``/``chatcmpl-``) never have that form."""
    m = _SAMPLE.match(key)
    return (m.group(2), int(m.group(1))) if m else (key, 0)


def request_label(key: str, randomized: bool = True) -> dict:
    """The columns naming an engine request (its internal id ``key``) in ``requests()``: ``request_id``
    (``RequestOutput.request_id``), ``sample`` (``CompletionOutput.index``) and ``engine_id`` (``key``)."""
    rid, sample = split_sample(user_key(key, randomized))
    return {"request_id": rid, "sample": sample, "engine_id": key}


def api_label(key: str, randomized: bool = True) -> dict:
    """The columns naming a served request in its line: ``request_label``'s, with ``request_id`` the id the
    OpenAI-compatible API returned and ``prompt_index`` the prompt's (a completion of several prompts)."""
    out = request_label(key, randomized)
    m = _COMPLETION.match(out["request_id"])
    if m:
        out.update(request_id=m.group(1), prompt_index=int(m.group(2)))
    return out


__all__ = ["api_label", "request_label", "split_sample", "user_key"]
