"""Shared model blocks (float32 numpy + :class:`runtime.linear.Linear` for stored weights).

``rms_norm`` (RMSNorm, LayerNorm), ``rope`` (default / linear / YaRN, both pair layouts),
``mla`` (multi-head latent attention, reconstructed and absorbed orders), ``dsa_indexer``
(DeepSeek sparse attention lightning indexer), ``moe_router`` (sigmoid + bias, group-limited
top-k), ``moe`` (route / union / apply_experts / shared), ``swiglu`` (gated MLP) and ``topk``
(``torch.topk``-compatible selection, ties included).

Shape legend: each layer module states its own.
"""
