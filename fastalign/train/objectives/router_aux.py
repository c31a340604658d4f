"""The router's load-balancing loss of a mixture-of-experts policy, added to an objective's loss as TRL's
trainers add it.

TRL 1.16's SFT, DPO, KTO, GRPO and RLOO trainers read ``router_aux_loss_coef`` (None: the model config's
own coefficient). A model whose config has ``output_router_logits`` (Mixtral, Qwen-MoE, GPT-OSS) then
runs every training forward with ``output_router_logits=True`` and adds ``coef · aux_loss`` to the loss,
unless the coefficient is 0, and logs ``aux_loss``; setting a coefficient for any other model is an error.
TRL's CPO and ORPO trainers (fastalign's cpo, simpo, orpo) have no such key: they add the model config's
``router_aux_loss_coef · aux_loss`` only where the model config turns ``output_router_logits`` on, and log
nothing. (A config that declares no coefficient, DeepSeek-V3's, whose router balances without an auxiliary
loss, counts as a model without one: TRL would multiply ``None``.)

The aux loss is one number per forward (a micro-batch's mean over its tokens), which TRL adds to each
micro-batch's loss: with gradient accumulation divided by the accumulation steps, and averaged over the
ranks by DDP. So a step's share of it is the mean over all the step's micro-batches, whatever their token
counts: ``start_step`` records ``1 / (micro-batches × ranks)``; in evaluation each batch's is its own.
"""

from __future__ import annotations

import torch

from fastalign.models.structure import base_model
from fastalign.train.config import ConfigError


class RouterAuxLoss:
    """What one objective adds for the router: ``coef`` is the ``router_aux_loss_coef`` key (None: the
    model config's), or, with ``config_key=False`` (TRL's CPO/ORPO), the model config alone decides."""

    def __init__(self, coef: float | None, *, config_key: bool = True):
        self.coef, self.config_key = coef, config_key
        self.weight, self.routed, self.enabled = 0.0, False, False
        self.share = 1.0

    def setup(self, model: torch.nn.Module) -> None:
        """Resolve the coefficient against the policy's config, as TRL's trainers do at init."""
        config = base_model(model).config.get_text_config()
        declared = getattr(config, "router_aux_loss_coef", None)
        self.routed = hasattr(config, "output_router_logits") and declared is not None
        if not self.config_key:
            self.weight = declared or 0.0
            self.enabled = bool(getattr(config, "output_router_logits", False)) and self.weight != 0.0
            return
        if self.coef and not self.routed:
            raise ConfigError(
                f"config key 'router_aux_loss_coef' is {self.coef}, but {config.model_type} is no "
                "mixture-of-experts model with a router's auxiliary loss: remove it"
            )
        self.weight = (declared or 0.0) if self.coef is None else self.coef
        self.enabled = self.routed and self.weight != 0.0

    def start_step(self, micro_batches: int, world_size: int) -> None:
        """The step's micro-batches on each rank: each one's aux loss counts for 1 / (that × ranks)."""
        self.share = 1.0 / (micro_batches * world_size)

    def forward_kwargs(self) -> dict[str, bool]:
        """What the policy's forward is called with: the router logits on or off, as TRL's SFT syncs
        the model config with the coefficient (0 turns a config's ``output_router_logits`` off); nothing
        for a model without a router."""
        return {"output_router_logits": self.enabled} if self.routed and self.config_key else {}

    def add(
        self, model: torch.nn.Module, loss: torch.Tensor, output, metrics: dict
    ) -> tuple[torch.Tensor, dict]:
        """``loss`` (this micro-batch's share of the step's) plus the weighted aux loss of ``output``
        (the policy's forward), and ``aux_loss`` in ``metrics`` where TRL logs it."""
        if not self.enabled:
            return loss, metrics
        if output.aux_loss is None:
            raise TypeError(
                "the router's aux loss is computed by fastalign's fused head: patch the model first "
                "(fastalign.patch_model; fastalign train does)"
            )
        share = self.share if model.training else 1.0
        aux = output.aux_loss.to(loss.device)
        loss = loss + self.weight * share * aux
        if self.config_key:
            metrics = {**metrics, "aux_loss": aux.detach() * share}
        return loss, metrics
