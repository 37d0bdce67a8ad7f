"""Analysis of converted models: activation and path patching, gradient attribution (:mod:`.patching`), QK/OV
circuits and composition (:mod:`.circuits`), visualisation (:mod:`.viz`)."""
