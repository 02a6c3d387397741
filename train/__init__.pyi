"""The names other stages import from lcap.train (lcap.faces)."""

from lcap.train.fit import NothingToLearn as NothingToLearn
from lcap.train.fit import equal_rewards as equal_rewards
from lcap.train.fit import read_report as read_report
from lcap.train.grpo import PREVIOUS_ROUND as PREVIOUS_ROUND
from lcap.train.grpo import PreviousRound as PreviousRound
from lcap.train.grpo import resolve_base_model as resolve_base_model
from lcap.train.grpo import round_dir as round_dir
from lcap.train.grpo import train_round as train_round
from lcap.train.options import TrainOptions as TrainOptions
from lcap.train.progress import training_text as training_text
from lcap.train.sft import sft_round as sft_round
