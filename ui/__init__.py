"""lcap.ui: `lcap ui`, a read-only web view of the store (episodes, conversations, tokens, rounds).

May import: lcap's core and the faces of capture, dataset, train and serve (not loop).

Its face (`__init__.pyi`) is empty: no other stage imports from it; the CLI registers its commands."""

from lcap.faces import attach_face

__getattr__, __dir__, __all__ = attach_face(__name__, __file__)
