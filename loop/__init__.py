"""Orchestration: `lcap loop` (collect -> build-dataset -> train -> deploy, resumable) and `lcap demo`.

May import: lcap's core and the faces of every stage below (capture, dataset, train, serve).

Its face (`__init__.pyi`) is empty: no other stage imports from it; the CLI registers its commands."""

from lcap.faces import attach_face

__getattr__, __dir__, __all__ = attach_face(__name__, __file__)
