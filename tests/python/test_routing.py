"""Replayed routing (kernmap.train.routing): transformers' routers of the three MoE families follow a recorded
run's choices — bit for bit the free run's arithmetic when nothing flips, the recorded experts when the router
would choose others (each counted, with its margin), through gradient checkpointing's recomputation — and a
replay that does not match its recording is refused by name."""

import copy

import pytest
import torch

from kernmap.train.routing import RoutingTape, routers

from hf_models import MOE_FAMILIES, batch, make_model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def negate_routers(model):
    with torch.no_grad():
        for r in routers(model):
            r.weight.neg_()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routers_replay_the_recorded_experts(family):
    model = make_model(family)
    n_routers = len(routers(model))
    assert n_routers == 2  # both decoder layers
    ids = batch()
    tape = RoutingTape()
    tape.record()
    hooks = tape.attach(model)
    loss, grads = loss_and_grads(model, ids)
    for h in hooks:
        h.remove()
    assert [len(c) for c in tape.calls] == [1] * n_routers

    # The same model replaying its own routing: the same loss and gradients bit for bit, no flip.
    again = copy.deepcopy(model)
    tape.replay()
    tape.attach(again)
    loss2, grads2 = loss_and_grads(again, ids)
    assert torch.equal(loss2, loss) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    f = tape.take_flips()
    assert (f.calls, f.tokens, f.flipped, f.max_margin) == (n_routers, n_routers * ids.numel(), 0, 0.0)

    # Routers that prefer the opposite experts (4 experts, top-2: disjoint choices): every token is counted as
    # flipped, the loss is not the free one, and without the tape it is again.
    other = copy.deepcopy(model)
    negate_routers(other)
    free_loss, _ = loss_and_grads(other, ids)
    tape.replay()
    handles = tape.attach(other)
    replayed_loss, _ = loss_and_grads(other, ids)
    f = tape.take_flips()
    assert f.flipped == n_routers * ids.numel() and f.max_margin > 0
    assert not torch.equal(replayed_loss, free_loss)
    for h in handles:
        h.remove()
    assert torch.equal(loss_and_grads(other, ids)[0], free_loss)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_experts_receive_the_recorded_choices(family):
    model = make_model(family)
    ids = batch()
    tape = RoutingTape()
    tape.record()
    tape.attach(model)
    loss_and_grads(model, ids)
    other = make_model(family)
    negate_routers(other)
    received = []  # what each sparse block hands its experts: (hidden, top_k_index, top_k_weights)
    for m in other.modules():
        if type(m).__name__.endswith("SparseMoeBlock"):
            m.experts.register_forward_pre_hook(lambda mod, args: received.append(args[1].clone()))
    tape.replay()
    tape.attach(other)
    loss_and_grads(other, ids)
    assert len(received) == len(tape.calls)
    for got, calls in zip(received, tape.calls):
        assert torch.equal(got.to(calls[0].dtype), calls[0])


def test_gradient_checkpointing_replays_its_recomputation():
    model = make_model("qwen3_moe")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = batch()
    other = copy.deepcopy(model)
    tape = RoutingTape()
    tape.record()
    tape.attach(model)
    loss, grads = loss_and_grads(model, ids)
    assert [len(c) for c in tape.calls] == [2, 2]  # the forward and the backward's recomputation
    tape.replay()
    tape.attach(other)
    loss2, grads2 = loss_and_grads(other, ids)
    assert torch.equal(loss2, loss) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    assert tape.take_flips().calls == 4


def test_a_replay_that_does_not_match_its_recording_is_refused():
    with pytest.raises(RuntimeError, match="nothing was recorded"):
        RoutingTape().replay()
    model = make_model("qwen3_moe")
    tape = RoutingTape()
    tape.record()
    tape.attach(model)
    with torch.no_grad():
        model(input_ids=batch(), use_cache=False)
    other = make_model("qwen3_moe")
    tape.replay()
    tape.attach(other)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"routes \[tokens, k\] = \[12, 2\], the recorded call "
                                                            r"\[18, 2\]"):
        other(input_ids=batch(shape=(2, 6)), use_cache=False)
    tape.replay()
    with torch.no_grad():
        other(input_ids=batch(), use_cache=False)
        with pytest.raises(RuntimeError, match="call 2 of router 0 is past the 1 calls recorded"):
            other(input_ids=batch(), use_cache=False)
    with pytest.raises(RuntimeError, match="the model has 2 routers, the recording 3"):
        tape.calls.append([])
        tape.replay()
        tape.attach(make_model("qwen3_moe"))
