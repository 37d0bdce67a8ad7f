"""What every bridge reader shares, and the registry of readers (public: a reader outside lens_aot uses it too).

* :mod:`~lens_aot.tl.reading.registry`: the reader registry (model readers, attention readers, attention forwards);
* :mod:`~lens_aot.tl.reading.record`: the typed records readers return (``AttentionReading``, ``ModelReading``);
* :mod:`~lens_aot.tl.reading.pieces`: the helpers every piece reader uses (sub-components, wrapped modules,
  projections, copies, refusals); :mod:`~lens_aot.tl.reading.probe`: the recorded forward a reading is checked
  against, and ``refuse_piece``; :mod:`~lens_aot.tl.reading.attention_checks`: the refusals attention readers share;
* the pieces every source has, read by structure: norms (:mod:`~lens_aot.tl.reading.norms`, with
  :mod:`~lens_aot.tl.reading.float32`, :mod:`~lens_aot.tl.reading.gemma_norm`,
  :mod:`~lens_aot.tl.reading.gemma4_norms`), dense MLPs (:mod:`~lens_aot.tl.reading.mlp`) and their activations
  (:mod:`~lens_aot.tl.reading.activation`).

This folder imports nothing else of :mod:`lens_aot.tl`: the readers in ``tl/attention``, ``tl/blocks``, ``tl/moe`` and
``tl/bridge`` build on it, and :mod:`lens_aot.tl.builtin_readers` registers them.
"""
