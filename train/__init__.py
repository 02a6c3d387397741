"""Train: TRL GRPO (and SFT) on captured samples, with the off-policy correction against the serving policy.

May import: lcap's core, lcap.capture and lcap.dataset (their faces).

Its face: other stages import from `lcap.train` only the names its `__init__.pyi` lists, each loaded on first use
(lcap.faces), so importing the stage alone loads none of its modules."""

from lcap.faces import attach_face

__getattr__, __dir__, __all__ = attach_face(__name__, __file__)
