"""Serve: the policy on vLLM (LoRA hot-loading), its record, deploys, and the tiny model lcap makes.

May import: lcap's core, lcap.capture and lcap.dataset (their faces).

Its face: other stages import from `lcap.serve` only the names its `__init__.pyi` lists, each loaded on first use
(lcap.faces), so importing the stage alone loads none of its modules."""

from lcap.faces import attach_face

__getattr__, __dir__, __all__ = attach_face(__name__, __file__)
