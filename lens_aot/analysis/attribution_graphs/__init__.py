"""Attribution graphs for one prompt over the converted model's own neurons: build (graph), node bookkeeping (nodes),
batched backward passes (run), circuit-tracer's pruning (prune), graph JSON (export), checks against hooks (verify) and
the offline page (page)."""
