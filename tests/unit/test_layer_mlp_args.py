"""Every MLP class h3t-ext's local layer specs use builds the way each supported megatron-core's TransformerLayer
calls it: ``tp_group=`` (0.16-0.18) and ``pg_collection=, is_mtp_layer=`` (0.19+, where only megatron-core's own MLP
class is routed through ``MLP.as_mlp_submodule``). The second lease's Megatron loop on megatron-core 0.19.2 failed at
ckpt=ours with "MLP.__init__() got an unexpected keyword argument 'pg_collection' when instantiating OursMLP"."""
from __future__ import annotations

import pytest
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import build_module

from h3t_ext.runtime.modules.gpt import tiny_llama_config
from h3t_ext.runtime.modules.layer_specs import h3t_layer_spec
from h3t_ext.ckpt import Recompute
from tests.activation_harness import init_single_process_megatron


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    init_single_process_megatron()


@pytest.mark.parametrize("ckpt", ["no", "ours"])
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("recompute_mlp", [False, True])
def test_each_mlp_of_the_specs_builds_with_either_layer_convention(ckpt, normalization, recompute_mlp):
    config = tiny_llama_config(num_layers=1, normalization=normalization)
    recompute = Recompute.parse("selective", modules=["mlp"]) if recompute_mlp else Recompute()
    spec = h3t_layer_spec(config, ckpt=ckpt, recompute=recompute).submodules.mlp
    groups = ProcessGroupCollection.use_mpu_process_groups()
    old = build_module(spec, config=config, tp_group=groups.tp)
    if spec.module is MLP:  # megatron-core's own class: 0.19's layer builds it through MLP.as_mlp_submodule itself
        new = old
    else:
        new = build_module(spec, config=config, pg_collection=groups, is_mtp_layer=False)
    for mlp in (old, new):
        assert isinstance(mlp, spec.module) and isinstance(mlp, MLP)
        assert mlp.tp_group is groups.tp
    assert [p.shape for p in new.parameters()] == [p.shape for p in old.parameters()]


class _AsSubmodule(MLP):
    """Stands in for megatron-core 0.19's MLP, whose classmethod builds a layer's MLP from pg_collection."""

    @classmethod
    def as_mlp_submodule(cls, submodules, config, pg_collection, is_mtp_layer, **kw):
        del is_mtp_layer
        return cls(config=config, submodules=submodules, tp_group=pg_collection.tp, **kw)


def test_the_recomputed_mlp_of_either_spec_form_builds_the_wrapped_class():
    """A stock spec's MLP wrapped for Megatron's selective ``mlp`` recompute: a ModuleSpec (0.16-0.18) and 0.19's
    ``partial(MLP.as_mlp_submodule, submodules=...)`` both build the recomputed class."""
    import functools

    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from h3t_ext.runtime.modules.layer_mlp import replace_mlp_class
    from h3t_ext.runtime.modules.recompute import recomputed_module
    from h3t_ext.runtime.modules.sequence_parallel import SPColumnParallelLinear, SPRowParallelLinear

    config = tiny_llama_config(num_layers=1)
    subs = MLPSubmodules(linear_fc1=SPColumnParallelLinear, linear_fc2=SPRowParallelLinear)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    spec = replace_mlp_class(ModuleSpec(module=MLP, submodules=subs), recomputed_module)
    assert spec.module is recomputed_module(MLP) and getattr(spec.module, "h3t_recomputed", False)
    built = build_module(spec, config=config, pg_collection=groups, is_mtp_layer=False)
    assert type(built) is recomputed_module(MLP)
    partial = replace_mlp_class(functools.partial(_AsSubmodule.as_mlp_submodule, submodules=subs), recomputed_module)
    built = partial(config=config, pg_collection=groups, is_mtp_layer=False)
    assert type(built) is recomputed_module(_AsSubmodule) and built.tp_group is groups.tp
    with pytest.raises(TypeError, match="neither a ModuleSpec nor"):
        replace_mlp_class(lambda **kw: None, recomputed_module)
