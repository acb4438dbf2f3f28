"""Every private or undocumented torch, ipyparallel, ipykernel, transformers and triton API colab_par
relies on.

These APIs can change in any release without a deprecation. Keeping them here means a version
drift fails with one `CompatError` naming the supported range, instead of an AttributeError deep
inside a training step, and one test per entry (tests/test_compat.py) checks the installed
versions. An entry whose API is missing raises `CompatError`; the few that return a fallback
instead (a slower path, never a wrong one) say so in their docstring, and their test proves the
installed versions take the fast path. Everything else in the kit uses public APIs only:
tests/test_compat.py scans the package for private torch, transformers, triton and ipyparallel
names outside this folder (the exceptions it still allows are listed there, each with its
reason). Imports are lazy: transformers stays optional, and the notebook client never pays for
engine-side modules. The entries live by topic, and every one is importable from here:

  support.py               the supported ranges, `CompatError`
  torch_distributed.py     DCP metadata, DeviceMesh, pipelining stages, DTensor, FSDP2
  torch_process_groups.py  process groups, collective sequence numbers, flight recorder, GPU UUIDs
  torch_modules.py         nn.Module internals, the activation-checkpoint wrapper
  torch_ops.py             private aten ops and kernels, dispatch modes, op and storage metadata
  torch_compile.py         compile time, dynamo's recompile limit, inductor's vector width
  fake_world.py            the `fake` process group, torch's memory tracker (planning/dry_run/)
  trees.py                 pytrees (`torch.utils._pytree`)
  triton_runtime.py        triton's interpreter
  hf.py                    transformers models' plans, recorded outputs and token losses
  ipp_controller.py        how engines and the controller start
  ipp_client.py            an ipyparallel client's internals, control requests
  ipykernel_engine.py      an engine's kernel: shell dispatch, output and status, control answers
"""
from colab_par.compat import (hf, ipp_client, support, torch_compile, torch_distributed, torch_ops, trees,
                              triton_runtime)
from colab_par.compat.hf import hf_output_recorder, hf_token_losses, hf_tp_plan
from colab_par.compat.ipp_client import (client_context, client_io_loop, client_metadata, client_reply_handler,
                                         engine_idents, failed_at, mux_stream, output_futures,
                                         send_control_requests, task_futures, unanswered)
from colab_par.compat.ipp_controller import (CONTROLLER_MAIN_CODE, ENGINE_MAIN_CODE, ENGINE_MAIN_FILE,
                                             prompt_heart_monitor, run_controller)
from colab_par.compat.ipykernel_engine import (after_output, answer_control_requests, engine_kernel, engine_shell,
                                               ipp_engine_kernel_class, output_mark, output_since, publish_status)
from colab_par.compat.support import SUPPORTED, CompatError
from colab_par.compat.torch_compile import (compile_seconds, failing_at_recompile_limit, pin_inductor_vector_width,
                                            recompile_limit, recompile_limit_error)
from colab_par.compat.torch_distributed import (DCP_METADATA_GLOBALS, STAGE_COMPUTE_HOOKS, check_stage_compute_hooks,
                                               dcp_metadata_path, dtensor_over, flatten_mesh, forget_dtensor_plans,
                                               fsdp_offload_policy, local_shard_offsets, storage_holder,
                                               unflatten_mesh)
from colab_par.compat.torch_modules import (checkpoint_wrapper, module_reset, non_persistent_buffers,
                                            reset_ddp_reducer, swapped_parameters, unwrapped_name)
from colab_par.compat.torch_ops import (assert_async, device_constructors, fused_optimizer_devices, grouped_mm,
                                        grouped_mm_is_one_op, op_schema, sdpa_aten_ops, storage_key,
                                        torch_dispatch_mode)
from colab_par.compat.torch_process_groups import (flight_record, gpu_uuids, group_sequence, process_groups,
                                                   rebind_group, registered_gloo_group)
from colab_par.compat.trees import tree_flatten, tree_leaves, tree_map, tree_unflatten
from colab_par.compat.triton_runtime import triton_interpreted

__all__ = ["CompatError", "SUPPORTED", "DCP_METADATA_GLOBALS", "dcp_metadata_path", "flatten_mesh",
           "STAGE_COMPUTE_HOOKS", "check_stage_compute_hooks", "hf_tp_plan",
           "ipp_engine_kernel_class", "ENGINE_MAIN_CODE", "ENGINE_MAIN_FILE",
           "CONTROLLER_MAIN_CODE", "prompt_heart_monitor", "run_controller", "task_futures",
           "engine_kernel", "engine_shell", "after_output", "publish_status", "engine_idents", "mux_stream",
           "client_context",
           "client_io_loop", "client_reply_handler", "unanswered",
           "checkpoint_wrapper", "sdpa_aten_ops",
           "torch_dispatch_mode", "pin_inductor_vector_width", "device_constructors", "op_schema", "storage_key",
           "module_reset",
           "triton_interpreted", "assert_async", "tree_flatten", "tree_unflatten", "tree_map", "tree_leaves",
           "hf_token_losses", "answer_control_requests", "send_control_requests", "group_sequence",
           "process_groups", "compile_seconds", "grouped_mm", "grouped_mm_is_one_op", "fused_optimizer_devices",
           "recompile_limit",
           "failing_at_recompile_limit", "recompile_limit_error", "swapped_parameters", "hf_output_recorder",
           "storage_holder", "dtensor_over", "fsdp_offload_policy", "non_persistent_buffers", "client_metadata",
           "failed_at", "flight_record", "gpu_uuids", "local_shard_offsets", "output_futures", "output_mark",
           "output_since", "rebind_group", "registered_gloo_group", "forget_dtensor_plans", "unflatten_mesh",
           "unwrapped_name", "reset_ddp_reducer"]

# The topics' private helpers, reachable from here too (tests/test_compat.py builds errors with
# `compat._missing`).
_missing, _torch_private = support._missing, support._torch_private
_GROUPED_DTYPES, _SDPA_OPS = torch_ops._GROUPED_DTYPES, torch_ops._SDPA_OPS
_COMPILE_PHASES, _dynamo_config = torch_compile._COMPILE_PHASES, torch_compile._dynamo_config
_ABSENT = torch_distributed._ABSENT
_is_transformers_model = hf._is_transformers_model
_client_part = ipp_client._client_part
_pytree = trees._pytree
_interpreted_function = triton_runtime._interpreted_function
