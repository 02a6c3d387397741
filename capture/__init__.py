"""Capture: an embedded mitmproxy that logs every LLM call of an unmodified agent as a turn: `lcap proxy`,
`lcap episode new`, `lcap ca`, `--sandbox`, and the spool -> writer -> store path.

May import: lcap's core.

Its face: other stages import from `lcap.capture` only the names its `__init__.pyi` lists, each loaded on first use
(lcap.faces), so importing the stage alone loads none of its modules."""

from lcap.faces import attach_face

__getattr__, __dir__, __all__ = attach_face(__name__, __file__)
