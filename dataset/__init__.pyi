"""The names other stages import from lcap.dataset (lcap.faces)."""

from lcap.dataset.build.builder import build_dataset as build_dataset
from lcap.dataset.build.builder import last_report as last_report
from lcap.dataset.build.explain import Cause as Cause
from lcap.dataset.build.explain import explain as explain
from lcap.dataset.build.explain import lost_lines as lost_lines
from lcap.dataset.build.explain import plural as plural
from lcap.dataset.build.merge import merge_turns as merge_turns
from lcap.dataset.build.samples_file import read_samples_table as read_samples_table
from lcap.dataset.build.samples_file import write_samples as write_samples
from lcap.dataset.collect.episode import FINISHED as FINISHED
from lcap.dataset.collect.episodes import EpisodePool as EpisodePool
from lcap.dataset.collect.episodes import check_round_is_free as check_round_is_free
from lcap.dataset.collect.episodes import collect_episodes as collect_episodes
from lcap.dataset.collect.episodes import load_tasks as load_tasks
from lcap.dataset.collect.episodes import plan_collect as plan_collect
from lcap.dataset.collect.on_ray import NodeProxies as NodeProxies
from lcap.dataset.options import BuildOptions as BuildOptions
from lcap.dataset.options import CollectOptions as CollectOptions
