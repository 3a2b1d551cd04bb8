"""Loading pickled framework dumps without running code from them.

Unpickling can execute arbitrary code: a pickle names callables (``module.name``) that the loader imports and
calls. The adapters therefore never call ``pickle.load`` or ``torch.load(weights_only=False)`` on a dump unless
the user passes ``--trust-pickle``:

- slime (``torch.save`` files): ``torch.load(weights_only=True)`` (torch's own restricted unpickler: tensors,
  builtin containers and scalars), with numpy arrays, dtypes and scalars added to its allow-list, because sample
  metadata often carries them. Any other class is refused with its name.
- SkyRL (``pickle`` of ``TrainingInputBatch``): ``SkyRLUnpickler`` resolves only the batch class (to an inert
  stand-in that keeps the pickled state; SkyRL itself is never imported), its ``TensorFormat`` string enum (to the
  plain string), ``torch.device``, torch's tensor
  rebuild functions (storages re-read with ``torch.load(weights_only=True)``), numpy arrays/dtypes/scalars,
  ``collections.OrderedDict`` and a few builtin constructors. The tensors inside SkyRL's state are themselves
  ``torch.save`` bytes or raw numpy buffers, decoded with the same restrictions.
"""
from __future__ import annotations

import builtins
import collections
import io
import pickle
import warnings
from pathlib import Path

import numpy as np
import torch

from lab.errors import LabError

TRUST_HINT = "if you trust this file, pass --trust-pickle (unpickling can run code from the file)"


def _numpy_globals() -> list:
    import numpy.dtypes as nd

    core = getattr(np, "_core", None) or np.core
    out = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    out += [getattr(nd, n) for n in dir(nd) if n.endswith("DType")]
    return out


def _load(f, weights_only: bool = True):
    """``torch.load`` on the CPU, without torch's warning about the pickle protocol of a file that is not a
    ``torch.save`` archive (a bad file is one error line, not a warning and then the line)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        return torch.load(f, map_location="cpu", weights_only=weights_only)


def torch_load(path: Path, trust: bool = False):
    """``torch.load`` restricted to tensors, builtins and numpy (weights_only) unless ``trust``; a file it cannot
    read (truncated, corrupt, not a torch.save file), trusted or not, is one LabError."""
    path = Path(path)
    try:
        if trust:
            return _load(path, weights_only=False)
        with torch.serialization.safe_globals(_numpy_globals()):
            return _load(path)
    except LabError:
        raise
    except pickle.UnpicklingError as e:
        if trust:
            raise LabError(f"{path}: not a readable torch.save file, truncated or corrupt? ({_why(e)})") from None
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception:  # noqa: BLE001 - it cannot even list the file's classes: not a torch.save file
            raise LabError(f"{path}: not a readable torch.save file, truncated or corrupt? ({_why(e)})") from None
        allowed = {f"{g.__module__}.{g.__qualname__}" for g in _numpy_globals()}
        names = [n for n in names if n not in allowed]
        what = f"objects of class {', '.join(names[:3])}" if names else "objects beyond tensors, numpy and builtins"
        raise LabError(f"{path}: holds {what}, which the restricted loader refuses; {TRUST_HINT}") from None
    except (Exception, RecursionError) as e:  # noqa: BLE001 - a trusted pickle can fail in any way
        raise LabError(f"{path}: not a readable torch.save file, truncated or corrupt? ({_why(e)})") from None


def _why(e: BaseException) -> str:
    text = str(e).splitlines()[0].split(". ")[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:120]}" if text else type(e).__name__


# ------------------------------------------------------------------------------------------------ SkyRL
SKYRL_BATCH_MODULES = ("skyrl_train.training_batch", "skyrl.backends.skyrl_train.training_batch",
                       "skyrl.train.training_batch")
SKYRL_BATCH_CLASSES = ("TrainingInputBatch", "TensorBatch")


class SkyRLBatch(dict):
    """Inert stand-in for SkyRL's TensorBatch/TrainingInputBatch: keeps the pickled dict items and state."""

    def __setstate__(self, state):
        self.state = state

    def __reduce__(self):  # never re-pickled
        raise TypeError("SkyRLBatch is a read-only stand-in")


def _rebuild_batch(cls, state):
    obj = SkyRLBatch()
    obj.__setstate__(state)
    return obj


def _tensor_format(value):
    """SkyRL's ``TensorFormat(value)``: each field's encoding tag (``"numpy"``, ``"torch"``, ...) is a member of this
    ``StrEnum`` (``training_batch.py``, 0.4.0), which pickles as the class called on its value; a ``StrEnum``
    member is its string, so the plain string stands in."""
    if type(value) is not str:
        raise ValueError(f"TensorFormat of a {type(value).__name__}")
    return value


def _load_storage_bytes(b: bytes):
    return _load(io.BytesIO(b))


_BUILTINS = {"set", "frozenset", "slice", "complex", "bytearray", "range"}


class SkyRLUnpickler(pickle.Unpickler):
    """Resolves exactly what SkyRL's dumps reference; anything else raises ``LabError`` naming the class."""

    def __init__(self, file, *, source: Path, trust: bool = False):
        super().__init__(file)
        self.source, self.trust = source, trust

    def find_class(self, module, name):
        if module in SKYRL_BATCH_MODULES:
            if name in SKYRL_BATCH_CLASSES:
                return SkyRLBatch
            if name == "_rebuild_tensor_batch":
                return _rebuild_batch
            if name == "TensorFormat":
                return _tensor_format
        if (module, name) == ("torch", "device"):
            return torch.device
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage_bytes
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return getattr(torch._utils, name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("_codecs", "encode"):
            import codecs
            return codecs.encode
        if module == "builtins" and name in _BUILTINS:
            return getattr(builtins, name)
        if module.split(".")[0] == "numpy":
            for g in _numpy_globals():
                if g.__name__ == name and module in (g.__module__, "numpy.core.multiarray", "numpy._core.multiarray",
                                                    "numpy"):
                    return g
        if self.trust:
            return super().find_class(module, name)
        raise LabError(f"{self.source}: the pickle references {module}.{name}, which is not part of a SkyRL "
                       f"training-input dump; it was not loaded ({TRUST_HINT})")


def load_skyrl_pickle(path: Path, trust: bool = False) -> SkyRLBatch:
    """Read one ``global_step_N_training_input.pkl`` into a ``SkyRLBatch`` (state decoded by the caller)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            obj = SkyRLUnpickler(f, source=path, trust=trust).load()
    except LabError:
        raise
    except (Exception, RecursionError) as e:  # noqa: BLE001 - a corrupt (or trusted) pickle can fail in any way
        raise LabError(f"{path}: not a readable SkyRL pickle, truncated or corrupt? ({_why(e)})") from None
    if not isinstance(obj, SkyRLBatch):
        raise LabError(f"{path}: holds a {type(obj).__name__}, expected SkyRL's TrainingInputBatch")
    return obj


def decode_skyrl_field(value, *, source: Path, key: str):
    """One entry of a SkyRL batch state's ``batch_dict``: None, ``torch.save`` bytes (older SkyRL), or
    {"format": "numpy" | "torch", ...} (newer SkyRL); returns a tensor or None."""
    if value is None or torch.is_tensor(value):
        return value
    try:
        if isinstance(value, (bytes, bytearray)):
            out = _load(io.BytesIO(value))
        elif isinstance(value, dict) and value.get("format", "numpy") == "numpy":
            arr = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(tuple(value["shape"]))
            out = torch.from_numpy(arr.copy())
        elif isinstance(value, dict) and value.get("format") == "torch":
            out = _load(io.BytesIO(value["data"]))
        elif isinstance(value, dict) and value.get("format") == "tensor_list":
            return None  # ragged multimodal inputs: not a per-token quantity
        else:
            raise ValueError(f"unknown encoding {type(value).__name__}")
    except pickle.UnpicklingError:
        raise LabError(f"{source}: field {key!r} holds objects beyond tensors; {TRUST_HINT}") from None
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise LabError(f"{source}: field {key!r} cannot be decoded ({type(e).__name__}: {e})") from None
    if out is not None and not torch.is_tensor(out):
        raise LabError(f"{source}: field {key!r} decodes to a {type(out).__name__}, expected a tensor")
    return out
