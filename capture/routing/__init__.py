"""Where calls go: a fixed upstream or a policy replica per episode, the wire format of lcap's policy endpoints, and the stitching heads.

May import: lcap's core and capture.turns."""
