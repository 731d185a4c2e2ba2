"""Child process of ``test_verify_memory.py``: verify under address-space caps, one JSON line out.

``python _verify_memory_child.py CALIBRATION:FACTOR[:unshared] ...``: builds a small random Llama
whose weights are mostly its embeddings (``M`` bytes), warms verify up uncapped (imports, lazy
initialisation), then for each argument sets ``RLIMIT_AS`` to the virtual size after the warm-up plus
``FACTOR * M`` and runs ``verify(model, batch, calibration=CALIBRATION)``. ``unshared``: the copies
deep-copy the weights again (verify's memory before issue 31), the broken variant. Prints
``{"M": bytes, "runs": [{"arg", "calibration", "ok", "notes"} or {"arg", "error"}]}``.
"""

from __future__ import annotations

import gc
import json
import resource
import sys

import torch

from flexgroup import GroupedBatch
from flexgroup.verification import equivalence
from flexgroup.models.zoo import build_model
from flexgroup.verification.memory import status_bytes

VOCAB = 32000


def main(args: list[str]) -> None:
    torch.set_num_threads(1)
    model = build_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB).float()
    M = sum(p.numel() * p.element_size() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, VOCAB, (n,), generator=g)  # noqa: E731
    batch = GroupedBatch.from_groups([ids(16)], [[ids(4), ids(7), ids(2)]])
    for calibration in ("float64", "layerwise"):   # warm-up, uncapped (imports, lazy initialisation)
        equivalence.verify(model, batch, calibration=calibration)
    gc.collect()
    base = status_bytes("VmSize")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    share = equivalence.own_copy
    runs = []
    for arg in args:
        calibration, factor, *broken = arg.split(":")
        if broken:
            equivalence.own_copy = lambda m, share_parameters=False: share(m, False)  # noqa: E731
        gc.collect()
        resource.setrlimit(resource.RLIMIT_AS, (base + int(float(factor) * M), hard))
        try:
            r = equivalence.verify(model, batch, calibration=calibration)
            runs.append(dict(arg=arg, calibration=r.calibration, ok=r.ok, notes=r.notes))
        except (MemoryError, RuntimeError) as e:
            runs.append(dict(arg=arg, error=" ".join(str(e).split())[:200]))
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
            equivalence.own_copy = share
    print(json.dumps(dict(M=M, runs=runs)))


if __name__ == "__main__":
    main(sys.argv[1:])
