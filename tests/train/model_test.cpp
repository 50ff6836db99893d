// The model and its precision: what stays FP32 and by which of the three mechanisms, the tied
// head, the MoE's routing, losses and expert-bias balancing, and the FP8 scopes.
#include "attention.h"
#include "gpt.h"
#include "plan.h"

#include "mixprec/precision/cross_entropy.h"
#include "mixprec/quant/quant_linear.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/types.h>

#include <map>
#include <set>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

GptConfig tiny(mixprec::quant::Fp8Recipe fp8 = mixprec::quant::Fp8Recipe::kHybrid) {
  GptConfig c;
  c.seq_len = 16;
  c.layers = 2;
  c.d_model = 32;
  c.heads = 2;
  c.experts = 4;
  c.top_k = 2;
  c.quant.fp8(fp8);
  return c;
}

MixedModel build(c10::ScalarType dtype = at::kBFloat16,
                 mixprec::quant::Fp8Recipe fp8 = mixprec::quant::Fp8Recipe::kHybrid) {
  at::manual_seed(0);
  Precision p;
  p.dtype = dtype;
  p.quant.fp8(fp8);
  return apply_precision(Gpt(tiny(fp8)), p);
}

TEST(MixedModel, RouterExpertBiasAndNormsStayFp32EachByItsMechanism) {
  MixedModel m = build();
  std::map<std::string, const mixprec::ConversionEntry*> report;
  for (const auto& e : m.module->conversion_report().entries) report[e.name] = &e;
  for (int layer = 0; layer < 2; ++layer) {
    const std::string b = "blocks." + std::to_string(layer) + ".";
    EXPECT_EQ(report.at(b + "moe.router.weight")->reason, mixprec::KeepReason::kTensorMark);
    EXPECT_EQ(report.at(b + "moe.expert_bias")->reason, mixprec::KeepReason::kName);
    EXPECT_EQ(report.at(b + "moe.expert_bias")->kind, mixprec::TensorKind::kBuffer);
    EXPECT_EQ(report.at(b + "attn_norm.weight")->reason, mixprec::KeepReason::kPattern);
    EXPECT_EQ(report.at(b + "mlp_norm.bias")->reason, mixprec::KeepReason::kPattern);
  }
  EXPECT_EQ(report.at("final_norm.weight")->reason, mixprec::KeepReason::kPattern);
  for (const auto& p : m.module->named_parameters()) {
    const bool kept =
        p.key().find("norm") != std::string::npos || p.key().ends_with("router.weight");
    EXPECT_EQ(p.value().scalar_type(), kept ? at::kFloat : at::kBFloat16) << p.key();
  }
  for (const auto& b : m.module->named_buffers()) {
    EXPECT_EQ(b.value().scalar_type(), at::kFloat) << b.key() << ": the expert bias stays FP32";
  }
}

TEST(MixedModel, TheHeadIsTheTokenEmbeddingItself) {
  MixedModel m = build();
  for (const auto& p : m.module->named_parameters()) {
    EXPECT_EQ(p.key().find("head"), std::string::npos)
        << "no second tensor for the head: " << p.key();
  }
  // Logits are x · tok_embᵀ: a gradient on one logit column reaches exactly that embedding row.
  const at::Tensor tokens = at::zeros({1, 4}, at::kLong);  // every input is byte 0
  auto [logits, aux] = m.forward(tokens);
  EXPECT_EQ(logits.scalar_type(), at::kBFloat16) << "the loss reads BF16 logits in FP32 itself";
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{1, 4, 256}));
  logits.select(2, 200).sum().backward();
  const at::Tensor grad = m.gpt->tok_emb->weight.grad().to(at::kFloat);
  EXPECT_GT(grad[200].abs().sum().item<double>(), 0.0) << "row 200 is the head's column";
  EXPECT_GT(grad[0].abs().sum().item<double>(), 0.0) << "row 0 is the embedded input";
  EXPECT_EQ(grad[100].abs().sum().item<double>(), 0.0) << "other rows are untouched";
}

TEST(MixedModel, ExpertGemmsRunInFp8AndTheRouterInFp32) {
  MixedModel m = build();
  m.forward(at::randint(0, 256, {2, 16}, at::kLong));
  auto& moe = *m.gpt->blocks[0]->as<BlockImpl>()->moe;
  EXPECT_TRUE(moe.router->last_compute().kept_fp32);
  EXPECT_EQ(moe.router->last_compute().operands, mixprec::quant::QuantFormat::kNone);
  EXPECT_EQ(moe.router->last_compute().dtype, at::kFloat);
  int fp8_experts = 0;
  for (const auto& expert : *moe.experts) {
    const auto& fc = *expert->as<ExpertImpl>()->fc;
    if (fc.last_compute().operands == mixprec::quant::QuantFormat::kFp8Hybrid) ++fp8_experts;
    if (fc.last_compute().operands != mixprec::quant::QuantFormat::kNone) {
      EXPECT_EQ(fc.last_compute().dtype, at::kBFloat16);
    }
  }
  EXPECT_GE(fp8_experts, 2) << "32 tokens with top-2 reach at least two experts";

  MixedModel plain = build(at::kBFloat16, mixprec::quant::Fp8Recipe::kOff);
  plain.forward(at::randint(0, 256, {2, 16}, at::kLong));
  auto& plain_moe = *plain.gpt->blocks[0]->as<BlockImpl>()->moe;
  for (const auto& expert : *plain_moe.experts) {
    EXPECT_EQ(expert->as<ExpertImpl>()->fc->last_compute().operands,
              mixprec::quant::QuantFormat::kNone);
  }
}

TEST(MoE, TopKRoutingMatchesADenseReferenceAndCountsLoad) {
  // FP32, no FP8: the dispatched output equals Σ_k gate_k · expert_k(x) computed densely.
  at::manual_seed(1);
  MoE moe(8, 4, 2, mixprec::quant::QuantConfig{});
  const at::Tensor x = at::randn({10, 8});
  const MoEOutput out = moe->forward(x);
  torch::NoGradGuard no_grad;
  const at::Tensor probs = at::softmax(at::linear(x, moe->router->weight), -1);
  const at::Tensor chosen = std::get<1>(at::topk(probs + moe->expert_bias, 2, -1));
  at::Tensor gates = probs.gather(-1, chosen);
  gates = gates / gates.sum(-1, true);
  at::Tensor expected = at::zeros_like(x);
  for (int64_t t = 0; t < 10; ++t) {
    for (int64_t k = 0; k < 2; ++k) {
      auto& e = *moe->experts[chosen[t][k].item<int64_t>()]->as<ExpertImpl>();
      expected[t] += gates[t][k] * e.forward(x[t].unsqueeze(0)).squeeze(0);
    }
  }
  EXPECT_TRUE(at::allclose(out.y, expected, 1e-5, 1e-6));
  EXPECT_EQ(moe->load().sum().item<int64_t>(), 20) << "10 tokens x top-2";
  // Switch-style balancing loss: E · Σ f_e P_e.
  const at::Tensor share = at::bincount(chosen.reshape(-1), {}, 4).to(at::kFloat) / 20.0;
  EXPECT_NEAR(out.aux_loss.item<double>(), (4.0 * (share * probs.mean(0)).sum()).item<double>(),
              1e-6);
}

// An expert no token chose is not run: it gets no gradient, so an optimizer skips it (its
// momentum and weight decay leave it alone), as one process does for any unused parameter. The
// others get theirs, from the right tokens: the input's gradient equals the dense reference's.
TEST(MoE, AnExpertWithoutTokensGetsNoGradient) {
  at::manual_seed(3);
  MoE moe(8, 4, 2, mixprec::quant::QuantConfig{});
  {
    torch::NoGradGuard no_grad;
    moe->expert_bias[3] = -10.0;  // steers every token away from expert 3
  }
  const at::Tensor x = at::randn({10, 8}).requires_grad_();
  moe->forward(x).y.square().sum().backward();
  for (int64_t e = 0; e < 4; ++e) {
    const auto& expert = *moe->experts[e]->as<ExpertImpl>();
    EXPECT_EQ(expert.fc->weight.grad().defined(), e != 3) << "expert " << e;
    EXPECT_EQ(expert.proj->weight.grad().defined(), e != 3) << "expert " << e;
  }
  EXPECT_EQ(moe->load()[3].item<int64_t>(), 0);

  const at::Tensor x_dense = x.detach().clone().requires_grad_();
  const at::Tensor probs = at::softmax(at::linear(x_dense, moe->router->weight), -1);
  at::Tensor chosen;
  {
    torch::NoGradGuard no_grad;
    chosen = std::get<1>(at::topk(probs + moe->expert_bias, 2, -1));
  }
  at::Tensor gates = probs.gather(-1, chosen);
  gates = gates / gates.sum(-1, true);
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < 10; ++t) {
    at::Tensor row = at::zeros({8});
    for (int64_t k = 0; k < 2; ++k) {
      auto& e = *moe->experts[chosen[t][k].item<int64_t>()]->as<ExpertImpl>();
      row = row + gates[t][k] * e.forward(x_dense[t].unsqueeze(0)).squeeze(0);
    }
    rows.push_back(row);
  }
  at::stack(rows).square().sum().backward();
  EXPECT_TRUE(at::allclose(x.grad(), x_dense.grad(), 1e-5, 1e-6));
}

TEST(MoE, ExpertBiasMovesTowardsEvenLoadAndTheCounterRestarts) {
  at::manual_seed(2);
  MoE moe(8, 4, 1, mixprec::quant::QuantConfig{});
  {
    torch::NoGradGuard no_grad;
    moe->expert_bias.copy_(at::tensor({10.0f, 0.0f, 0.0f, 0.0f}));  // everything goes to expert 0
  }
  moe->forward(at::randn({12, 8}));
  EXPECT_EQ(moe->load()[0].item<int64_t>(), 12);
  moe->update_expert_bias(0.5);
  EXPECT_TRUE(at::equal(moe->expert_bias, at::tensor({9.5f, 0.5f, 0.5f, 0.5f})));
  EXPECT_EQ(moe->load().sum().item<int64_t>(), 0);
  moe->eval();
  moe->forward(at::randn({12, 8}));
  EXPECT_EQ(moe->load().sum().item<int64_t>(), 0) << "evaluation does not count as load";
}

// --recompute (recompute.h): each block runs again in backward. The loss, every parameter's
// gradient and the experts' load counts are bitwise those of the plain run, with and without
// FP8, and the recomputing autograd node is really in the graph.
TEST(MixedModel, RecomputedBlocksGiveTheSameLossGradientsAndLoadBitForBit) {
  using mixprec::quant::Fp8Recipe;
  for (const Fp8Recipe fp8 : {Fp8Recipe::kHybrid, Fp8Recipe::kOff}) {
    SCOPED_TRACE(fp8 == Fp8Recipe::kHybrid ? "fp8 hybrid" : "fp8 off");
    struct Result {
      at::Tensor loss;
      std::map<std::string, at::Tensor> grads;
      std::vector<at::Tensor> loads;
      int recompute_nodes = 0;
    };
    std::vector<Result> results;
    for (const bool recompute : {false, true}) {
      at::manual_seed(3);
      GptConfig c = tiny(fp8);
      c.recompute = recompute;
      Precision p;
      p.dtype = at::kBFloat16;
      p.quant.fp8(fp8);
      MixedModel m = apply_precision(Gpt(c), p);
      m.module->train();
      const at::Tensor tokens = at::randint(0, 256, {4, 16}, at::kLong);
      const at::Tensor targets = at::randint(0, 256, {4 * 16}, at::kLong);
      auto [logits, aux] = m.forward(tokens);
      Result r;
      r.loss = mixprec::cross_entropy_in_fp32(logits.flatten(0, 1), targets) + 0.01 * aux;
      // Every node reachable from the loss: one recomputing node per block, or none.
      std::vector<torch::autograd::Node*> pending = {r.loss.grad_fn().get()};
      std::set<torch::autograd::Node*> seen;
      while (!pending.empty()) {
        torch::autograd::Node* node = pending.back();
        pending.pop_back();
        if (node == nullptr || !seen.insert(node).second) continue;
        r.recompute_nodes += node->name().find("RecomputedBlock") != std::string::npos ? 1 : 0;
        for (const auto& edge : node->next_edges()) pending.push_back(edge.function.get());
      }
      r.loss.backward();
      for (const auto& item : m.module->named_parameters()) {
        if (item.value().grad().defined()) r.grads[item.key()] = item.value().grad().clone();
      }
      for (const at::Tensor& load : m.gpt->expert_loads()) r.loads.push_back(load.clone());
      results.push_back(std::move(r));
    }
    const Result &plain = results[0], &recomputed = results[1];
    EXPECT_EQ(plain.recompute_nodes, 0);
    EXPECT_EQ(recomputed.recompute_nodes, 2) << "one per block";
    EXPECT_TRUE(at::equal(plain.loss, recomputed.loss));
    ASSERT_EQ(plain.grads.size(), recomputed.grads.size());
    EXPECT_GE(plain.grads.size(), 20u);
    for (const auto& [name, grad] : plain.grads) {
      ASSERT_TRUE(recomputed.grads.count(name)) << name << " got no gradient when recomputed";
      EXPECT_TRUE(at::equal(grad, recomputed.grads.at(name))) << name;
    }
    ASSERT_EQ(plain.loads.size(), recomputed.loads.size());
    for (size_t i = 0; i < plain.loads.size(); ++i) {
      EXPECT_TRUE(at::equal(plain.loads[i], recomputed.loads[i]))
          << "block " << i << ": the recomputation must not count the tokens again";
    }
  }
}

// attention.h: the FP32 attention on half q, k, v gives bitwise what autograd through the
// casts and at::scaled_dot_product_attention gives, on the permuted views the model passes.
TEST(CausalAttention, MatchesTheCastReferenceBitForBit) {
  for (const c10::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::manual_seed(4);
    // [B, T, 3, heads, head_dim] → three [B, heads, T, head_dim] views, as gpt.cpp makes them.
    const at::Tensor qkv = at::randn({2, 16, 3, 3, 8}).to(dtype).requires_grad_();
    const auto heads = [&] {
      const at::Tensor v = qkv.permute({2, 0, 3, 1, 4});
      return std::vector<at::Tensor>{v[0], v[1], v[2]};
    };
    const at::Tensor grad = at::randn({2, 3, 16, 8});
    auto h = heads();
    const at::Tensor mine = causal_attention_in_fp32(h[0], h[1], h[2]);
    mine.backward(grad);
    const at::Tensor my_grad = qkv.grad().clone();
    qkv.mutable_grad().reset();
    h = heads();
    const at::Tensor reference = at::scaled_dot_product_attention(
        h[0].to(at::kFloat), h[1].to(at::kFloat), h[2].to(at::kFloat), {}, 0.0, /*is_causal=*/true);
    reference.backward(grad);
    EXPECT_EQ(mine.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(mine, reference));
    EXPECT_EQ(my_grad.scalar_type(), dtype);
    EXPECT_TRUE(at::equal(my_grad, qkv.grad()));
  }
  const at::Tensor q = at::randn({1, 2, 4, 8});
  EXPECT_THROW(causal_attention_in_fp32(q, q, q.narrow(2, 0, 2)), c10::Error);
  EXPECT_THROW(causal_attention_in_fp32(q.to(at::kDouble), q.to(at::kDouble), q.to(at::kDouble)),
               c10::Error);
}

TEST(MixedModel, Fp16KeepsTheSameTensorsFp32) {
  MixedModel m = build(at::kHalf);
  EXPECT_EQ(m.gpt->tok_emb->weight.scalar_type(), at::kHalf);
  EXPECT_EQ(m.gpt->blocks[0]->as<BlockImpl>()->moe->router->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(m.gpt->blocks[0]->as<BlockImpl>()->moe->expert_bias.scalar_type(), at::kFloat);
  auto [logits, aux] = m.forward(at::randint(0, 256, {2, 16}, at::kLong));
  EXPECT_TRUE(at::isfinite(logits).all().item<bool>());
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
