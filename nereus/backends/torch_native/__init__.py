"""``torch_native``: the reference engine, any (tp, pp, dp) on CPU (gloo) or GPU (NCCL/RCCL).

One module per concern, composed by ``engine.TorchNativeEngine`` (the Backend):

- ``stage``: ``BoundStage``, this rank's pipeline stage bound to the EMU buffers (TP through
  DTensor) and the grid's groups; the stage-to-stage pass, scoring, inference ``forward``;
- ``training``: ``train_step`` (PP through ``torch.distributed.pipelining``), gradient
  reductions, the DP all-reduce, clipping and ``FlatAdamW``;
- ``generation``: batched decoding with a KV cache;
- ``weights``: Hugging Face checkpoints in and out.
Edge module (torch.distributed).
"""

from nereus.backends.torch_native.engine import TorchNativeEngine

__all__ = ["TorchNativeEngine"]
