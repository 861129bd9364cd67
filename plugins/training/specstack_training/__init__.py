"""Training for specstack, a plugin distribution: ``specstack train draft`` distils a draft model
from a target (:mod:`specstack_training.distill`). The command registers through the ``specstack``
entry points like any third party's (:mod:`specstack_training.plugin`)."""
