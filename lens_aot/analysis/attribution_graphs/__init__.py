"""Attribution graphs for one prompt over the converted model's own neurons: the graph (graph), its construction
(build), node bookkeeping (nodes), batched backward passes (run), circuit-tracer's pruning (prune), graph JSON
(export), checks against hooks (verify) and the offline page (page, with its page.html / page.css / page.js)."""
