"""The names other stages import from lcap.serve (lcap.faces)."""

from lcap.serve.deploy import check_lora_rank as check_lora_rank
from lcap.serve.deploy import deploy_policy as deploy_policy
from lcap.serve.deploy import deploy_roles as deploy_roles
from lcap.serve.deploy import forget_candidate as forget_candidate
from lcap.serve.deploy import load_candidate as load_candidate
from lcap.serve.deploy import make_current as make_current
from lcap.serve.deploy import make_roles_current as make_roles_current
from lcap.serve.deploy import record_deployment as record_deployment
from lcap.serve.options import TinyModelOptions as TinyModelOptions
from lcap.serve.pretrained import STAMP as STAMP
from lcap.serve.pretrained import init_pretrained as init_pretrained
from lcap.serve.pretrained import pretrained_dir as pretrained_dir
from lcap.serve.server import start_server as start_server
from lcap.serve.server import stop_server as stop_server
from lcap.serve.tiny_model import init_model as init_model
from lcap.serve.vllm_env import has_gpu as has_gpu
