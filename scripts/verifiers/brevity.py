"""Verifier command: shorter answers score higher, reward = 1 / (1 + words in answer.txt).

A shaping reward that varies even for an untrained model, handy for smoke runs. Reads the
answer the agent wrote into its working directory (the verifier's cwd) and prints a float.
"""

from pathlib import Path

words = Path("answer.txt").read_text().split() if Path("answer.txt").exists() else []
print(1.0 / (1 + len(words)))
