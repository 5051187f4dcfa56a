"""Several SSDs: copies of a model, device identity, bandwidth weights, placement, failover.

A model directory (the *primary*) may have mirrors (``--mirror DIR``, repeatable): full or
partial copies on other drives. A copy file is used only when its size and its safetensors
header bytes (the first ``8 + N`` bytes) equal the primary's; anything else is skipped with one
warning naming the file and why. A partial copy simply holds fewer shard files.

Which copy serves an expert (:meth:`Placement.choose`) is decided by weighted rendezvous hashing
of ``(layer, expert)``: each copy holding the expert's shard scores
``weight / -ln(hash(layer, expert, copy))`` and the best score wins. The share of experts a
copy serves is exactly proportional to its weight, the mapping is deterministic (same weights,
same choices, in every process), a prefetch and a demand read of one expert go to the same
device, and a weight change moves only the experts that must move. Weights are declared
(``--disk-weights 2,1``, primary first) or probed at open with a few expert-sized O_DIRECT reads
per device (cached per device in ``.coli_devices.json`` in the state dir).

At run time each copy's read throughput (bytes over read time, per window of 16 reads) is
tracked as an exponentially weighted moving average; weights are re-bucketed only when an
estimate moves more than 20% from the weights in use (hysteresis), so a throttled or busy drive
gets less and the mapping stays fixed between adaptations. A read error or short read on a
copy is retried on the primary (then any other copy holding the file), counted, reported
once per device, and the copy is demoted (weight 0) until :meth:`Placement.enable`; a
:class:`~storage.errors.ReadError` reaches the model only when every copy failed. Placement
only decides speed: the bytes are the same everywhere.

The modules: :mod:`~storage.multidisk.identity` (which device a path lives on; whether a file
may stand in for the primary's), :mod:`~storage.multidisk.placement` (which copy serves each
read; adaptation, striping, failover, telemetry), :mod:`~storage.multidisk.probing` (bandwidth
probes and :func:`~storage.multidisk.probing.open_placement`, the entry point) and
:mod:`~storage.multidisk.staging` (``coli mirror plan|stage|verify``). One word for a copy: the
*primary* model directory and each *mirror* (``--mirror DIR``) are the model's *copies*.
"""

__all__: list[str] = []
