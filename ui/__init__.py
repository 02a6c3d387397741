"""lcap.ui: `lcap ui`, a read-only web view of the store (episodes, conversations, tokens, rounds)."""
