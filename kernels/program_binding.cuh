// Host side, shared by the fused op (gemm_epilogue.cpp) and its backward (epilogue_backward.cpp): the op table,
// the program parser (cached per program string), the binding of a program to one call's shapes, and the row
// kernels' launch geometry. Entry points: cached_program(text), bind(ctx, binding), choose_row_layout(features),
// place_groups(code, layout, vec, features).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "program_format.cuh"

namespace fxfuse {
namespace {

// ================================================================ the op table, host side

enum class Category { Unary, Binary, FeatureAffine, Norm, Reduction };

struct OpInfo {
  const char* name;
  uint8_t opcode;
  Category category;
  int operands;
  int attrs;
  NormAttrs norm_attrs;
  bool takes_numbers;       // a binary op: whether an operand may be a number (torch.maximum's may not)
  bool takes_number_first;  // ... and its first one too (torch.copysign's may not)
};

constexpr int norm_operands(NormAttrs a) {
  return a == NormAttrs::Dim || a == NormAttrs::DimEps ? 1 : (a == NormAttrs::EpsOrFloatEps ? 2 : 3);
}
constexpr int norm_attr_count(NormAttrs a) { return a == NormAttrs::GroupsEps || a == NormAttrs::DimEps ? 2 : 1; }

#define FXFUSE_UNARY_INFO(name, F) {#name, OP_##name, Category::Unary, 1, F::num_attrs, NormAttrs::Eps, false, false},
#define FXFUSE_BINARY_INFO(name, F) \
  {#name, OP_##name, Category::Binary, 2, 0, NormAttrs::Eps, TakesNumbers<F>::value, TakesNumberFirst<F>::value},
#define FXFUSE_AFFINE_INFO(name, F) {#name, OP_##name, Category::FeatureAffine, 5, 1, NormAttrs::Eps, false, false},
#define FXFUSE_NORM_INFO(name, F) \
  {#name, OP_##name, Category::Norm, norm_operands(F::attrs), norm_attr_count(F::attrs), F::attrs, false, false},
#define FXFUSE_REDUCTION_INFO(name, F) \
  {#name, OP_##name, Category::Reduction, 1, 2 + ReductionExtraAttrs<F>::value, NormAttrs::Dim, false, false},
const OpInfo kOps[] = {FXFUSE_UNARY_OPS(FXFUSE_UNARY_INFO) FXFUSE_BINARY_OPS(FXFUSE_BINARY_INFO)
                           FXFUSE_FEATURE_AFFINE_OPS(FXFUSE_AFFINE_INFO) FXFUSE_NORM_OPS(FXFUSE_NORM_INFO)
                               FXFUSE_REDUCTION_OPS(FXFUSE_REDUCTION_INFO)};
#undef FXFUSE_UNARY_INFO
#undef FXFUSE_BINARY_INFO
#undef FXFUSE_AFFINE_INFO
#undef FXFUSE_NORM_INFO
#undef FXFUSE_REDUCTION_INFO

// An op by its name in a program. A trailing '_' (the model's in-place op, whose value keeps its first operand's
// dtype: fxfuse/program.py) is the op itself here, where every value has the one storage type.
const OpInfo* find_op(std::string name) {
  if (!name.empty() && name.back() == '_') name.pop_back();
  for (const OpInfo& op : kOps)
    if (name == op.name) return &op;
  return nullptr;
}

std::string supported_ops() {
  std::string names;
  for (const OpInfo& op : kOps) names += (names.empty() ? "" : ",") + std::string(op.name);
  return names;
}

// Chains of opcodes by op name, for the listing ops: "group_norm,clamp;add".
std::string chain_names(std::initializer_list<std::initializer_list<Opcode>> chains) {
  std::string text;
  for (const auto& chain : chains) {
    std::string names;
    for (const Opcode opcode : chain)
      for (const OpInfo& op : kOps)
        if (op.opcode == opcode) names += (names.empty() ? "" : ",") + std::string(op.name);
    text += (text.empty() ? "" : ";") + names;
  }
  return text;
}

#define FXFUSE_CHAIN_LIST(...) {__VA_ARGS__},
std::string row_chains() {
  return chain_names({FXFUSE_ROW_CHAINS(FXFUSE_CHAIN_LIST) FXFUSE_LIBM_ROW_CHAINS(FXFUSE_CHAIN_LIST)});
}
std::string tail_chains() { return chain_names({FXFUSE_TAIL_CHAINS(FXFUSE_CHAIN_LIST)}); }
#undef FXFUSE_CHAIN_LIST

// ================================================================ parsing (cached per program string)

struct Token {
  enum Kind { Value, Param, Number, None, Bool, String } kind = None;
  int index = 0;       // Value, Param
  double number = 0;   // Number, Bool
  bool integer = false;  // Number written as an integer ('16', not '16.0'), as program.py's parse_token reads it
  std::string text;    // String
};

struct ParsedInstruction {
  const OpInfo* op;
  std::vector<Token> operands;
  std::vector<Token> attrs;
};

struct ParsedProgram {
  std::vector<ParsedInstruction> instructions;
  std::vector<int> last_use;  // per value: the last instruction reading it (-1: none)
  std::string error;          // non-empty: the kernels cannot run this program
};

std::string trim(const std::string& s) {
  const size_t begin = s.find_first_not_of(" \t\n");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t\n") - begin + 1);
}

std::vector<std::string> split(const std::string& s, char separator) {
  std::vector<std::string> items;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || s[i] == separator) {
      items.push_back(trim(s.substr(start, i - start)));
      start = i + 1;
    }
  }
  return items;
}

bool parse_token(const std::string& text, Token& token) {
  if (text.empty()) return false;
  char* end = nullptr;
  if (text[0] == '%' || text[0] == '$') {
    const long long index = std::strtoll(text.c_str() + 1, &end, 10);
    // past int's range the index would wrap (%4294967296 read as %0): the reference's error then runs instead
    if (end == text.c_str() + 1 || *end != '\0' || index < 0 || index > std::numeric_limits<int>::max()) return false;
    token.kind = text[0] == '%' ? Token::Value : Token::Param;
    token.index = static_cast<int>(index);
    return true;
  }
  if (text.size() >= 2 && text.front() == '\'' && text.back() == '\'') {
    token.kind = Token::String;
    token.text = text.substr(1, text.size() - 2);
    return true;
  }
  if (text == "None") return token.kind = Token::None, true;
  if (text == "True" || text == "False") {
    token.kind = Token::Bool;
    token.number = text == "True" ? 1.0 : 0.0;
    return true;
  }
  // strtod also reads hexadecimal (0x10) and NaN payloads (nan(1)), which program.py's float() refuses
  if (text.find_first_of("xX(") != std::string::npos) return false;
  std::strtoll(text.c_str(), &end, 10);  // read only to see whether an integer spans the whole text
  token.integer = *end == '\0';
  token.number = std::strtod(text.c_str(), &end);
  token.kind = Token::Number;
  return *end == '\0';
}

std::shared_ptr<const ParsedProgram> parse_program(const std::string& text) {
  auto program = std::make_shared<ParsedProgram>();
  for (const std::string& item : split(text, ';')) {
    if (item.empty()) continue;
    const size_t open = item.find('(');
    const std::string name = open == std::string::npos ? "" : trim(item.substr(0, open));
    const OpInfo* op = name.empty() ? nullptr : find_op(name);
    if (op == nullptr || item.back() != ')') {
      program->error = "unknown instruction '" + item + "'";
      return program;
    }
    const std::string inside = trim(item.substr(open + 1, item.size() - open - 2));
    const std::vector<std::string> texts = inside.empty() ? std::vector<std::string>{} : split(inside, ',');
    if (static_cast<int>(texts.size()) != op->operands + op->attrs) {
      program->error = "wrong argument count in '" + item + "'";
      return program;
    }
    ParsedInstruction instruction{op, {}, {}};
    for (size_t i = 0; i < texts.size(); ++i) {
      Token token;
      if (!parse_token(texts[i], token)) {
        program->error = "bad token '" + texts[i] + "' in '" + item + "'";
        return program;
      }
      const bool is_operand = static_cast<int>(i) < op->operands;
      if (is_operand && token.kind == Token::Value &&
          token.index > static_cast<int>(program->instructions.size())) {
        program->error = "'" + item + "' reads a value before it is defined";
        return program;
      }
      (is_operand ? instruction.operands : instruction.attrs).push_back(token);
    }
    const bool in_place = name.back() == '_';
    if (in_place && (instruction.operands.empty() || instruction.operands[0].kind != Token::Value)) {
      program->error = "in-place '" + item + "' changes no value of the program";  // the reference raises
      return program;
    }
    program->instructions.push_back(std::move(instruction));
  }
  if (program->instructions.size() > static_cast<size_t>(kMaxInstructions) / 2) {
    program->error = "more than " + std::to_string(kMaxInstructions / 2) + " instructions";
    return program;
  }
  program->last_use.assign(program->instructions.size() + 1, -1);
  for (size_t i = 0; i < program->instructions.size(); ++i)
    for (const Token& t : program->instructions[i].operands)
      if (t.kind == Token::Value) program->last_use[t.index] = static_cast<int>(i);
  return program;
}

std::shared_ptr<const ParsedProgram> cached_program(const std::string& text) {
  static std::mutex mutex;
  static std::unordered_map<std::string, std::shared_ptr<const ParsedProgram>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find(text);
  if (found != cache.end()) return found->second;
  auto program = parse_program(text);
  cache.emplace(text, program);
  return program;
}

// ================================================================ binding a program to the call's shapes

using Shape = std::vector<int64_t>;

// Where a value of the row phase lives relative to the GEMM output's rows.
enum class RowShape { Full, PerRowKeepdim, PerRow, Outside };

struct Binding {
  std::vector<Instruction> row_code, tail_code;
  std::vector<RowParam> row_params;
  std::vector<int> row_param_sources;   // per row param: the index of the program param it views
  std::vector<Shape> value_shapes;      // of %0, %1, ... as bound (the row phase's, then the tail's)
  std::vector<at::Tensor> tail_params;  // the params the tail reads, in operand order (after the row result)
  std::vector<int> tail_param_sources;  // per tail param: the index of the program param it is
  Shape row_result_shape, output_shape;
  RowShape row_result_kind = RowShape::Full;
  int slots_used = 0;
  bool has_tail = false;
};

struct Context {
  const ParsedProgram& program;
  const at::Tensor& x;
  at::TensorList params;
  Shape lead, full;
  int64_t features;
  int vec;  // elements per 16 bytes
};

RowShape classify(const Context& ctx, const Shape& shape) {
  if (shape == ctx.full) return RowShape::Full;
  Shape keep = ctx.lead;
  keep.push_back(1);
  if (shape == keep) return RowShape::PerRowKeepdim;
  if (shape == ctx.lead) return RowShape::PerRow;
  return RowShape::Outside;
}

// Encodes a pointwise attribute token as the functors read it. A NaN number is not taken: it would read as None
// (clamp(x, nan) is NaN everywhere in torch, clamp(x, None) is x).
bool encode_attribute(const Token& t, float& out) {
  switch (t.kind) {
    case Token::Number:
    case Token::Bool:
      out = static_cast<float>(t.number);
      return !std::isnan(t.number);
    case Token::None:
      out = NAN;
      return true;
    case Token::String:
      if (t.text == "none" || t.text == "tanh") return out = t.text == "tanh" ? 1.0f : 0.0f, true;
      return false;
    default:
      return false;
  }
}

bool is_number(const Token& t) { return t.kind == Token::Number || t.kind == Token::Bool; }

// Whether a unary op's attribute is of a kind its reference takes (eager raises TypeError for the others): a number
// (an int, a float or a bool); None too for clamp's bounds and logit's eps; for gelu's `approximate`, only a string.
bool attribute_kind_fits(uint8_t opcode, const Token& t) {
  if (opcode == OP_gelu) return t.kind == Token::String;
  if (t.kind == Token::None) return opcode == OP_clamp || opcode == OP_logit;
  return is_number(t);
}

// An integer literal: what eager takes for a dim or a group count (a float or a bool there raises TypeError).
bool is_integer(const Token& t) { return t.kind == Token::Number && t.integer; }

// True where `dim` is an integer naming the last of `rank` dims (eager raises for one out of range).
bool is_last_dim(const Token& dim, int64_t rank) {
  if (!is_integer(dim)) return false;
  const int64_t d = static_cast<int64_t>(dim.number);
  return d == -1 || d == rank - 1;
}

void set_attribute(Attrs& attrs, size_t index, float value) {
  (index == 0 ? attrs.a0 : index == 1 ? attrs.a1 : attrs.a2) = value;
}

// Whether torch's CUDA kernel of the op reads its numbers in the tensor's own dtype (`value.to<scalar_t>()`: in
// bf16 hardshrink's 0.3 is 0.30078125), where the others read them in fp32.
bool reads_numbers_in_storage_dtype(uint8_t opcode) {
  return opcode == OP_hardshrink || opcode == OP_softshrink || opcode == OP_threshold;
}

float in_dtype(float value, at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return static_cast<float>(c10::BFloat16(value));
  if (dtype == at::kHalf) return static_cast<float>(c10::Half(value));
  return value;
}

// The (row, feature) strides of param p broadcast to a row-phase value of shape `shape`.
bool row_param_view(const Context& ctx, const at::Tensor& p, const Shape& shape, RowShape kind, RowParam& view) {
  const at::Tensor expanded = p.expand(shape);
  const int rank = static_cast<int>(shape.size());
  const int lead_dims = kind == RowShape::PerRow ? rank : rank - 1;
  const int64_t feature_stride = kind == RowShape::Full && ctx.features > 1 ? expanded.stride(rank - 1) : 0;
  int64_t row_stride = 0;
  for (int d = lead_dims - 1; d >= 0; --d)
    if (shape[d] > 1) {
      row_stride = expanded.stride(d);
      break;
    }
  int64_t expected = row_stride;
  for (int d = lead_dims - 1; d >= 0; --d) {
    if (shape[d] > 1 && expanded.stride(d) != expected) return false;
    expected *= shape[d];
  }
  view.ptr = p.data_ptr();
  view.row_stride = row_stride;
  view.feature_stride = feature_stride;
  view.vector_loads = feature_stride == 1 && row_stride % ctx.vec == 0 && ctx.features % ctx.vec == 0 &&
                      reinterpret_cast<uintptr_t>(view.ptr) % 16 == 0;
  return true;
}

// The row param for `view` of program param `source` (-1: none, such as the backward's grad_output), shared by
// identical views; -1 where all kMaxParams are taken.
int add_row_param(Binding& b, const RowParam& view, int source) {
  for (size_t i = 0; i < b.row_params.size(); ++i) {
    const RowParam& o = b.row_params[i];
    if (o.ptr == view.ptr && o.row_stride == view.row_stride && o.feature_stride == view.feature_stride &&
        b.row_param_sources[i] == source)
      return static_cast<int>(i);
  }
  if (b.row_params.size() == static_cast<size_t>(kMaxParams)) return -1;
  b.row_params.push_back(view);
  b.row_param_sources.push_back(source);
  return static_cast<int>(b.row_params.size()) - 1;
}

// A norm's per-feature operand: None, or a param of shape [N].
bool feature_operand(const Context& ctx, Binding& b, const Token& t, int8_t& slot) {
  if (t.kind == Token::None) return slot = -1, true;
  if (t.kind != Token::Param || t.index >= static_cast<int>(ctx.params.size())) return false;
  const at::Tensor& p = ctx.params[t.index];
  if (p.dim() != 1 || p.size(0) != ctx.features) return false;
  RowParam view{p.data_ptr(), 0, p.stride(0), false};
  view.vector_loads = p.stride(0) == 1 && ctx.features % ctx.vec == 0 &&
                      reinterpret_cast<uintptr_t>(view.ptr) % 16 == 0;
  const int index = add_row_param(b, view, t.index);
  slot = static_cast<int8_t>(index);
  return index >= 0;
}

// Places values in the current register array and the slots; emits OP_SAVE / OP_LOAD where needed.
struct SlotAllocator {
  const std::vector<int>& last_use;
  std::vector<Instruction>& code;
  int current;
  int slot_value[kMaxSlots] = {-1, -1};
  int high_water = 0;

  int slot_of(int value) const {
    for (int s = 0; s < kMaxSlots; ++s)
      if (slot_value[s] == value) return s;
    return -1;
  }
  bool save_current() {
    if (slot_of(current) >= 0) return true;
    for (int s = 0; s < kMaxSlots; ++s)
      if (slot_value[s] < 0) {
        slot_value[s] = current;
        high_water = std::max(high_water, s + 1);
        Instruction move{};
        move.op = OP_SAVE;
        move.slot = static_cast<uint8_t>(s);
        code.push_back(move);
        return true;
      }
    return false;
  }
  // Makes `value` current before instruction i; false where it is lost or the slots are full.
  bool make_current(int value, int i) {
    if (current == value) return true;
    const int s = slot_of(value);
    if (s < 0) return false;
    if (last_use[current] >= i && !save_current()) return false;
    Instruction move{};
    move.op = OP_LOAD;
    move.slot = static_cast<uint8_t>(s);
    code.push_back(move);
    current = value;
    return true;
  }
  // Keeps the current value for readers after instruction i, then retires values last read by i.
  bool before_overwrite(int i) { return last_use[current] <= i || save_current(); }
  void after(int i) {
    current = i + 1;
    for (int s = 0; s < kMaxSlots; ++s)
      if (slot_value[s] >= 0 && last_use[slot_value[s]] <= i) slot_value[s] = -1;
  }
};

// prelu's slopes as eager's prelu reads them: one, or one per channel (dim 1 of the value; a 1-D value has one
// channel) viewed as [1, C, 1, ...]; an undefined tensor where eager raises, so that the reference raises there.
at::Tensor prelu_weight_as_read(const at::Tensor& weight, const Shape& value_shape) {
  const size_t rank = value_shape.size();
  const int64_t channels = rank > 1 ? value_shape[1] : 1;
  if (weight.dim() > 1 || rank == 0 || (weight.numel() != 1 && weight.numel() != channels)) return {};
  Shape shape(rank, 1);
  if (rank > 1) shape[1] = weight.numel();
  return weight.view(shape);
}

// Binds the instructions [begin, end) of one phase. `row_phase` selects the row kernel's operand views.
std::string bind_phase(const Context& ctx, Binding& b, std::vector<Shape>& shapes, int begin, int end, bool row_phase) {
  std::vector<Instruction>& code = row_phase ? b.row_code : b.tail_code;
  SlotAllocator slots{ctx.program.last_use, code, begin};
  for (int i = begin; i < end; ++i) {
    const ParsedInstruction& pi = ctx.program.instructions[i];
    const std::string where = " in instruction " + std::to_string(i) + " (" + pi.op->name + ")";
    if (!row_phase && pi.op->category != Category::Unary && pi.op->category != Category::Binary)
      return "a " + std::string(pi.op->name) + " after a broadcast beyond the rows" + where;
    Instruction ins{};
    ins.op = pi.op->opcode;
    for (int8_t& p : ins.param) p = -1;
    const Token* main = &pi.operands[0];
    const Token* other = pi.operands.size() > 1 ? &pi.operands[1] : nullptr;
    if (pi.op->category == Category::Binary) {
      const bool a_value = pi.operands[0].kind == Token::Value, b_value = pi.operands[1].kind == Token::Value;
      if (!a_value && !b_value) return "no value operand" + where;
      if (pi.op->opcode == OP_prelu && (!a_value || pi.operands[1].kind != Token::Param))
        return "prelu's input is not a value or its slopes are not a param" + where;
      if (!a_value || (b_value && pi.operands[1].index == slots.current && pi.operands[0].index != slots.current))
        std::swap(main, other), ins.reversed = 1;
    }
    if (main->kind != Token::Value) return "the first operand is not a value" + where;
    if (!row_phase && main->index < begin) return "the tail reads a value of the row phase" + where;
    if (!slots.make_current(main->index, i)) return "more than " + std::to_string(kMaxSlots) + " live values" + where;

    const Shape& in_shape = shapes[main->index];
    Shape out_shape = in_shape;
    switch (pi.op->category) {
      case Category::Unary:
        for (size_t a = 0; a < pi.attrs.size(); ++a) {
          float value;
          if (!attribute_kind_fits(pi.op->opcode, pi.attrs[a])) return "an attribute its op does not take" + where;
          if (!encode_attribute(pi.attrs[a], value)) return "unsupported attribute" + where;
          if (reads_numbers_in_storage_dtype(pi.op->opcode)) value = in_dtype(value, ctx.x.scalar_type());
          set_attribute(ins.attrs, a, value);
        }
        if (pi.op->opcode == OP_clamp && std::isnan(ins.attrs.a0) && std::isnan(ins.attrs.a1))
          return "clamp without bounds" + where;
        break;
      case Category::Binary: {
        Shape other_shape;
        at::Tensor param;  // a param operand, as the op reads it
        if (other->kind == Token::Value) {
          if (!row_phase && other->index < begin) return "the tail reads a value of the row phase" + where;
          other_shape = shapes[other->index];
          const int slot = slots.slot_of(other->index);
          if (other->index != slots.current && slot < 0) return "operand value not kept" + where;
          ins.other = other->index == slots.current ? OTHER_CURRENT : static_cast<uint8_t>(OTHER_SLOT0 + slot);
        } else if (other->kind == Token::Param) {
          if (other->index >= static_cast<int>(ctx.params.size())) return "param out of range" + where;
          param = ctx.params[other->index];
          if (pi.op->opcode == OP_prelu) param = prelu_weight_as_read(param, in_shape);
          if (!param.defined()) return "prelu's slopes are neither one nor one per channel (eager raises)" + where;
          other_shape = param.sizes().vec();
          ins.other = OTHER_PARAM;
        } else if (is_number(*other)) {
          // reversed: the number is the first operand
          if (!pi.op->takes_numbers || (ins.reversed && !pi.op->takes_number_first))
            return "a number operand, which its op does not take" + where;
          ins.other = OTHER_SCALAR;
          ins.attrs.a0 = static_cast<float>(other->number);
        } else {
          return "operand is neither a tensor nor a number" + where;
        }
        try {
          out_shape = at::infer_size(in_shape, other_shape);
        } catch (const c10::Error&) {
          return "operands do not broadcast" + where;
        }
        if (row_phase) {
          const RowShape kind = classify(ctx, out_shape);
          if (kind == RowShape::Outside) break;  // the tail starts here; bind() splits
          const auto broadcasts_per_row = [&](const Shape& value) {
            const RowShape value_kind = classify(ctx, value);
            return value_kind == kind || (value_kind == RowShape::PerRowKeepdim && kind == RowShape::Full);
          };
          if (!broadcasts_per_row(in_shape) || (other->kind == Token::Value && !broadcasts_per_row(other_shape)))
            return "a value broadcasts across rows" + where;
          if (other->kind == Token::Param) {
            RowParam view;
            if (!row_param_view(ctx, param, out_shape, kind, view))
              return "param $" + std::to_string(other->index) + " has strides that are not (row, feature)" + where;
            const int index = add_row_param(b, view, other->index);
            if (index < 0) return "more than " + std::to_string(kMaxParams) + " param uses" + where;
            ins.param[0] = static_cast<int8_t>(index);
          }
        } else if (other->kind == Token::Param) {
          if (b.tail_params.size() + 1 == static_cast<size_t>(kMaxTailOperands))
            return "more than " + std::to_string(kMaxTailOperands - 1) + " params after a broadcast" + where;
          b.tail_params.push_back(param);
          b.tail_param_sources.push_back(other->index);
          ins.param[0] = static_cast<int8_t>(b.tail_params.size());
        }
        break;
      }
      case Category::FeatureAffine: {
        if (ctx.x.dim() != 2 || classify(ctx, in_shape) != RowShape::Full)
          return "batch_norm is row-local only for a 2-D x" + where;
        for (int k = 0; k < 4; ++k)
          if (!feature_operand(ctx, b, pi.operands[k + 1], ins.param[k])) return "unsupported feature operand" + where;
        if (ins.param[0] < 0 || ins.param[1] < 0 || !is_number(pi.attrs[0])) return "no running statistics" + where;
        ins.attrs.a0 = static_cast<float>(pi.attrs[0].number);
        break;
      }
      case Category::Norm: {
        if (classify(ctx, in_shape) != RowShape::Full) return "a norm of a value that is not a full row" + where;
        const NormAttrs kind = pi.op->norm_attrs;
        const Token& eps = pi.attrs.back();
        ins.group_size = static_cast<int32_t>(ctx.features);
        if (kind == NormAttrs::GroupsEps) {
          if (ctx.x.dim() != 2) return "group_norm is row-local only for a 2-D x" + where;
          const Token& groups = pi.attrs[0];
          if (!is_integer(groups)) return "num_groups is not an integer" + where;
          if (groups.number < 1 || ctx.features % static_cast<int64_t>(groups.number) != 0)
            return "num_groups does not divide the features" + where;
          ins.group_size = static_cast<int32_t>(ctx.features / static_cast<int64_t>(groups.number));
        }
        if ((kind == NormAttrs::Dim || kind == NormAttrs::DimEps) &&
            !is_last_dim(pi.attrs[0], static_cast<int64_t>(in_shape.size())))
          return std::string(pi.op->name) + " over a dim other than the last" + where;
        if (kind == NormAttrs::Dim) {  // softmax and log_softmax take no eps
        } else if (is_number(eps)) {
          ins.attrs.a0 = static_cast<float>(eps.number);
        } else if (eps.kind == Token::None && kind == NormAttrs::EpsOrFloatEps) {
          // F.rms_norm's default: the epsilon of the type it computes in, float for bf16 and fp16 too (with bf16's
          // own 2^-7 a bf16 model's default RMSNorm gave other values than eager's)
          ins.attrs.a0 = std::numeric_limits<float>::epsilon();
        } else {
          return "unsupported eps" + where;
        }
        for (int k = 1; k < static_cast<int>(pi.operands.size()); ++k)
          if (!feature_operand(ctx, b, pi.operands[k], ins.param[k - 1])) return "unsupported norm operand" + where;
        break;
      }
      case Category::Reduction: {
        if (classify(ctx, in_shape) != RowShape::Full) return "a reduction of a value that is not a full row" + where;
        const Token& keepdim = pi.attrs[1];
        if (!is_last_dim(pi.attrs[0], static_cast<int64_t>(in_shape.size())) || keepdim.kind != Token::Bool)
          return "a reduction over a dim other than the last" + where;
        for (size_t a = 2; a < pi.attrs.size(); ++a) {  // var's correction
          if (!is_number(pi.attrs[a])) return "an attribute that is not a number" + where;
          set_attribute(ins.attrs, a - 2, static_cast<float>(pi.attrs[a].number));
        }
        ins.group_size = static_cast<int32_t>(ctx.features);
        out_shape = ctx.lead;
        if (keepdim.number != 0.0) out_shape.push_back(1);
        break;
      }
    }
    if (row_phase && pi.op->category == Category::Binary && classify(ctx, out_shape) == RowShape::Outside) break;
    if (!slots.before_overwrite(i)) return "more than " + std::to_string(kMaxSlots) + " live values" + where;
    code.push_back(ins);
    shapes.push_back(out_shape);
    slots.after(i);
  }
  b.slots_used = std::max(b.slots_used, slots.high_water);
  return "";
}

// Binds the whole program: the row phase up to the first value that outgrows the rows, then the tail.
std::string bind(const Context& ctx, Binding& b) {
  std::vector<Shape> shapes{ctx.full};
  const int count = static_cast<int>(ctx.program.instructions.size());
  std::string reason = bind_phase(ctx, b, shapes, 0, count, true);
  if (!reason.empty()) return reason;
  const int split = static_cast<int>(shapes.size()) - 1;  // instructions bound in the row phase
  b.row_result_shape = shapes.back();
  b.row_result_kind = classify(ctx, b.row_result_shape);
  if (split < count) {
    // bind_phase stopped at a broadcast beyond the rows: drop the row phase's trailing moves for that instruction
    while (!b.row_code.empty() && (b.row_code.back().op == OP_SAVE || b.row_code.back().op == OP_LOAD))
      b.row_code.pop_back();
    b.has_tail = true;
    reason = bind_phase(ctx, b, shapes, split, count, false);
    if (!reason.empty()) return reason;
  }
  b.output_shape = shapes.back();
  b.value_shapes = shapes;
  if (b.row_code.size() + b.tail_code.size() > static_cast<size_t>(kMaxInstructions))
    return "too many instructions after slot moves";
  return "";
}

// ================================================================ launch geometry

struct RowLayout {
  int threads_per_row;
  int rows_per_block;
};

// The fewest threads (a power of 2, from a warp) that hold a row at `values` values each; short rows share
// 256-thread blocks.
std::optional<RowLayout> choose_row_layout(int64_t features, int values = kRowValues) {
  const int max_threads = kMaxRowFeatures / values;
  int threads = 32;
  while (static_cast<int64_t>(threads) * values < features && threads < max_threads) threads *= 2;
  if (static_cast<int64_t>(threads) * values < features) return std::nullopt;
  return RowLayout{threads, std::max(1, 256 / threads)};
}

// Fills the group fields of the norms and reductions now that the layout is known; returns the dynamic shared
// memory the row kernel needs, or -1 where a group layout does not fit.
int64_t place_groups(std::vector<Instruction>& code, const RowLayout& layout, int vec, int64_t features) {
  int64_t shared_bytes = 0;
  const int64_t chunk_row = static_cast<int64_t>(layout.threads_per_row) * vec;
  for (Instruction& ins : code) {
    if (ins.group_size == 0) continue;
    const int64_t size = ins.group_size;
    ins.group_mode = GROUP_ACROSS_LANES;
    ins.chunks_per_group = 1 << 30;
    ins.lanes_per_group = layout.threads_per_row;
    if (size == features) continue;
    if (size % chunk_row == 0) {
      ins.chunks_per_group = static_cast<int32_t>(size / chunk_row);
    } else if (size % vec == 0 && chunk_row % size == 0) {
      ins.chunks_per_group = 1;
      ins.lanes_per_group = static_cast<int32_t>(size / vec);
    } else if (size < vec && vec % size == 0) {  // chunks start at multiples of VEC: no group straddles two
      ins.group_mode = GROUP_IN_VECTOR;
    } else {
      ins.group_mode = GROUP_SHARED;
      shared_bytes = static_cast<int64_t>(layout.rows_per_block) * features * sizeof(float);
      if (shared_bytes > 48 * 1024) return -1;
    }
  }
  return shared_bytes;
}

}  // namespace
}  // namespace fxfuse
