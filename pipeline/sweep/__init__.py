"""The recipe search: a sweep's config (:mod:`.config`), its controller over trial runs (:mod:`.search`: Optuna's
ask-and-tell, Hyperband pruning, confirmation by paired seeds) and its conclusions (:mod:`.verdict`)."""
