"""Argument checks of the public entry points (decoder, loaders), run once per call before any
work: each error is a ``ValueError`` (a bad value) or ``TypeError`` (a wrong type) whose message
starts with the argument's name, then the request index where there is one, then the value. The
sampling arguments (:func:`check_sampling`) raise ``ValueError`` for a wrong type too, as the ops'
checks do, whose value rules they meet next."""

from __future__ import annotations

import numbers
import warnings

import torch

from ._checks import check_verify


def _is_int(value) -> bool:
    """Any integer but a bool (numpy ones too, unlike the ops' ``_checks.is_int``): a count given to the
    decoder or a loader is turned into a Python int here."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_count(name: str, value, minimum: int = 0) -> int:
    """``value`` as an int ``>= minimum``."""
    if not _is_int(value):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {_describe(value)}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def check_token(name: str, value, vocab: int) -> int | None:
    """``value`` as a token id in ``[0, vocab)``, or None."""
    if value is None:
        return None
    if not _is_int(value):
        raise TypeError(f"{name}: expected an int token id or None, got {type(value).__name__} {_describe(value)}")
    if not 0 <= value < vocab:
        raise ValueError(f"{name}: token id {value} outside the vocabulary [0, {vocab})")
    return int(value)


def _prompt_ids(index: int, prompt) -> list[int]:
    """One prompt as a list of ints (types only; ranges are checked by the caller)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex \
                or prompt.dtype == torch.bool:
            raise TypeError(f"prompts[{index}]: expected a 1-D integer tensor, got {prompt.dim()}-D "
                            f"{prompt.dtype}")
        return prompt.tolist()
    if _is_int(prompt):
        raise TypeError(f"prompts: expected a sequence of prompts (each a list, tuple or 1-D integer tensor of "
                        f"token ids), got the int {prompt} at index {index}; wrap a single prompt: [[...]]")
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"prompts[{index}]: expected a list, tuple or 1-D integer tensor of token ids, got "
                        f"{type(prompt).__name__} {_describe(prompt)}")
    if all(type(t) is int for t in prompt):  # the common case, without the slower ABC check
        return list(prompt)
    for position, token in enumerate(prompt):
        if not _is_int(token):
            raise TypeError(f"prompts[{index}][{position}]: expected an int token id, got "
                            f"{type(token).__name__} {_describe(token)}")
    return [int(t) for t in prompt]


def check_prompts(prompts, vocab: int) -> list[list[int]]:
    """``prompts`` (a list or tuple of prompts, or a 2-D integer tensor) as lists of token ids,
    each non-empty and in ``[0, vocab)``."""
    if isinstance(prompts, torch.Tensor) and prompts.dim() == 2:
        prompts = list(prompts)
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts: expected a list of prompts (each a list, tuple or 1-D integer tensor of token "
                        f"ids), got {type(prompts).__name__} {_describe(prompts)}")
    if not prompts:
        raise ValueError("prompts: expected at least one prompt, got an empty list")
    checked = []
    for index, prompt in enumerate(prompts):
        ids = _prompt_ids(index, prompt)
        if not ids:
            raise ValueError(f"prompts[{index}]: every prompt needs at least one token, got an empty prompt")
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(p for p, t in enumerate(ids) if not 0 <= t < vocab)
            raise ValueError(f"prompts[{index}][{bad}]: token id {ids[bad]} outside the vocabulary [0, {vocab})")
        checked.append(ids)
    return checked


def check_context(prompts: list[list[int]], max_new_tokens: int, max_positions: int, allow: bool) -> None:
    """Every prompt plus ``max_new_tokens`` within the model's ``max_positions``: an error, or
    with ``allow`` a warning (positions past the trained context decode, with no guarantee)."""
    for index, prompt in enumerate(prompts):
        total = len(prompt) + max_new_tokens
        if total > max_positions:
            message = (f"prompts[{index}]: {len(prompt)} prompt tokens + max_new_tokens {max_new_tokens} = {total} "
                       f"exceed the model's context of {max_positions} positions")
            if not allow:
                raise ValueError(message + " (allow_beyond_context=True decodes past it)")
            warnings.warn(message + ": decoding past the trained context", RuntimeWarning, stacklevel=3)
            return


def check_dtype(name: str, value, allow_none: bool = True) -> None:
    """``value`` a floating ``torch.dtype`` (or None)."""
    if value is None and allow_none:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name}: expected a torch.dtype such as torch.float32, got {type(value).__name__} "
                        f"{_describe(value)}")
    if not value.is_floating_point:
        raise ValueError(f"{name}: expected a floating dtype, got {value}")


def check_device(name: str, value) -> None:
    """``value`` None, a ``torch.device`` or a string torch parses as one."""
    if value is None or isinstance(value, torch.device):
        return
    if not isinstance(value, (str, int)):
        raise TypeError(f"{name}: expected a torch.device or a string such as 'cpu', got {type(value).__name__}")
    try:
        torch.device(value)
    except RuntimeError as error:
        raise ValueError(f"{name}: {value!r} is not a device ({error})") from None


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_same_device(device: torch.device, **values) -> None:
    """Every tensor among ``values`` (or, for ``prompts``, among its prompts) on ``device``: a
    tensor elsewhere would be copied on every call or fail inside a kernel."""
    for name, value in values.items():
        if name == "prompts" and isinstance(value, (list, tuple)):
            for index, prompt in enumerate(value):
                if isinstance(prompt, torch.Tensor) and not _same_device(prompt.device, device):
                    raise ValueError(f"prompts[{index}]: a tensor on {prompt.device}, the model on {device}")
        elif isinstance(value, torch.Tensor) and not _same_device(value.device, device):
            raise ValueError(f"{name}: a tensor on {value.device}, the model on {device}")


def check_capacity(prompts: list[list[int]], max_new_tokens: int, max_len: int) -> None:
    """Every prompt plus ``max_new_tokens`` within the ``max_len`` a decoder was warmed up for
    (its caches hold no more)."""
    for index, prompt in enumerate(prompts):
        total = len(prompt) + max_new_tokens
        if total > max_len:
            raise ValueError(f"prompts[{index}]: {len(prompt)} prompt tokens + max_new_tokens {max_new_tokens} = "
                             f"{total} exceed the cache capacity of {max_len} tokens set by warmup(max_len=...)")


# generate's per-request sampling arguments, in verify's order, with the dtype verify takes for each (docs/ops.md §4).
_SAMPLING_DTYPES = (("temperature", torch.float32), ("top_k", torch.int32), ("top_p", torch.float32),
                    ("seed", torch.int64))


def _sampling_value(name: str, value, dtype: torch.dtype) -> float | int:
    """One sampling value (a Python number or a 0-D tensor) as the Python number verify's ``dtype`` holds: a real
    number for a float dtype, an int within an integer dtype's range (top_k int32, seed int64), where a float
    would be truncated and a larger int overflow the conversion. Bools are neither, as in the ops' checks."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if dtype.is_floating_point:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            try:
                return float(value)  # past float32's range: inf, which verify's checks name
            except OverflowError:  # an int past any float
                raise ValueError(f"{name}: expected a real number within a float's range, got "
                                 f"{_describe(value)}") from None
        raise ValueError(f"{name}: expected a real number, got {type(value).__name__} {_describe(value)}")
    if not _is_int(value):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__} {_describe(value)}")
    info = torch.iinfo(dtype)
    if not info.min <= value <= info.max:
        bound = f"at most {info.max}" if value > info.max else f"at least {info.min}"
        raise ValueError(f"{name}: expected an int that fits verify's {str(dtype).removeprefix('torch.')} "
                         f"({bound}), got {value}")
    return int(value)


def _sampling_argument(name: str, value, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """One of generate's per-request sampling arguments as a CPU tensor [batch] of verify's ``dtype``: a scalar (a
    number or a 0-D tensor) is every request's value, a sequence or 1-D tensor holds one value per prompt. One of
    another length is an error, not broadcast (a length-1 list for a batch is more likely a mistake than a wish
    for one value; a scalar says that)."""
    per_prompt = isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.dim() > 0)
    if not per_prompt:
        return torch.tensor([_sampling_value(name, value, dtype)] * batch, dtype=dtype)
    expected = f"a scalar or one value per prompt ({batch} value{'s' if batch > 1 else ''})"
    if isinstance(value, torch.Tensor) and value.dim() != 1:
        raise ValueError(f"{name}: expected {expected}, got a tensor of shape {tuple(value.shape)}")
    if len(value) != batch:
        raise ValueError(f"{name}: expected {expected}, got {len(value)} value{'s' if len(value) != 1 else ''}")
    values = value.tolist() if isinstance(value, torch.Tensor) else value
    return torch.tensor([_sampling_value(f"{name}[{b}]", v, dtype) for b, v in enumerate(values)], dtype=dtype)


def check_sampling(batch: int, temperature, top_k, top_p, seed) -> tuple[torch.Tensor, ...]:
    """generate's ``temperature``, ``top_k``, ``top_p`` and ``seed`` as CPU tensors [batch] of verify's dtypes,
    checked before any kernel: their form and types here, their values by verify's own checks (the rules and
    messages verify applies to CPU tensors: temperature finite and >= 0, top_k >= 0, top_p in (0, 1]), run on a
    one-node tree of these values. ``EAGLE_KERNELS_CHECK_VALUES=0`` turns the value checks off, as in the ops.
    A wrong type is a ``ValueError`` here too, as in the ops' checks whose rules these values meet next."""
    sampling = {name: _sampling_argument(name, value, batch, dtype)
                for (name, dtype), value in zip(_SAMPLING_DTYPES, (temperature, top_k, top_p, seed))}
    check_verify(torch.zeros(batch, 1, dtype=torch.int64), torch.full((batch, 1), -1, dtype=torch.int32),
                 torch.zeros(batch, 1, 1), max_depth=0, **sampling)
    return tuple(sampling.values())
