"""Dataset: episodes, verifier rewards, LLM judges (`judge/`), cleaning, GRPO samples: `lcap collect`, `lcap reward`,
`lcap rescore`, `lcap build-dataset`, `lcap export`.

May import: lcap's core and lcap.capture (its face).

Its face: other stages import from `lcap.dataset` only the names its `__init__.pyi` lists, each loaded on first use
(lcap.faces), so importing the stage alone loads none of its modules."""

from lcap.faces import attach_face

__getattr__, __dir__, __all__ = attach_face(__name__, __file__)
