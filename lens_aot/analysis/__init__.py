"""Analysis of converted models: activation / path patching and gradient attribution (:mod:`.patching`)."""
