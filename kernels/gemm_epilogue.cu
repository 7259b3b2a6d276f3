// The CUDA implementation of torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program), and of
// gemm_epilogue_train (the same, returning y beside the result for the backward).
//
//   y = linear(x, weight, bias); then each instruction of `program` (fxfuse/program.py) in order.
//   Reference: fxfuse/program.py::run_reference (fxfuse/library.py::run_reference_train), op by op
//   fxfuse/epilogue.py.
//
// Strategy: the GEMM runs through ATen (at::linear on x viewed as [M, K], so cuBLAS(Lt) with its bias epilogue
// and torch's TF32 flags, exactly as eager), then ONE launch of the epilogue interpreter (interpreter.cuh) reads
// y once and writes it once, in place (gemm_epilogue_train: into a tensor of its own, as y is returned too).
// The program text is parsed once per distinct string and cached; each call binds it to the shapes at hand (a
// few hundred host instructions) into a compact instruction array that the kernel receives by value. A program
// whose value outgrows the rows by broadcasting (row min + a (1, N, 1, 1) bias gives (1, N, M, 1)) runs its row
// phase, then a second launch for its pointwise tail.
//
// Limits (anything else runs the reference through fxfuse::gemm_epilogue_fallback, or gemm_epilogue_train_fallback,
// with the reason logged):
// fp32 / bf16 / fp16, every tensor of one dtype, contiguous x, weight, bias, on one CUDA device; M >= 1;
// N <= 16384 (8192 for programs that keep values for later); norms and reductions over the last dim of a full
// row (group_norm and batch_norm of a 2-D x only); group sizes off the lanes' power-of-2 grid need N <= 12288
// (a row in 48 KB of shared memory); at most 16 instructions, 8 param uses, 2 live extra values; a broadcast
// tail of pointwise ops only, reading the row phase's last value, at most 3 params, 4 merged dims, 2^31 outputs.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
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
};

constexpr int norm_operands(NormAttrs a) {
  return a == NormAttrs::Dim ? 1 : (a == NormAttrs::EpsOrDtypeEps ? 2 : 3);
}
constexpr int norm_attr_count(NormAttrs a) { return a == NormAttrs::GroupsEps ? 2 : 1; }

#define FXFUSE_UNARY_INFO(name, F) {#name, OP_##name, Category::Unary, 1, F::num_attrs, NormAttrs::Eps},
#define FXFUSE_BINARY_INFO(name, F) {#name, OP_##name, Category::Binary, 2, 0, NormAttrs::Eps},
#define FXFUSE_AFFINE_INFO(name, F) {#name, OP_##name, Category::FeatureAffine, 5, 1, NormAttrs::Eps},
#define FXFUSE_NORM_INFO(name, F) \
  {#name, OP_##name, Category::Norm, norm_operands(F::attrs), norm_attr_count(F::attrs), F::attrs},
#define FXFUSE_REDUCTION_INFO(name, F) {#name, OP_##name, Category::Reduction, 1, 2, NormAttrs::Dim},
const OpInfo kOps[] = {FXFUSE_UNARY_OPS(FXFUSE_UNARY_INFO) FXFUSE_BINARY_OPS(FXFUSE_BINARY_INFO)
                           FXFUSE_FEATURE_AFFINE_OPS(FXFUSE_AFFINE_INFO) FXFUSE_NORM_OPS(FXFUSE_NORM_INFO)
                               FXFUSE_REDUCTION_OPS(FXFUSE_REDUCTION_INFO)};
#undef FXFUSE_UNARY_INFO
#undef FXFUSE_BINARY_INFO
#undef FXFUSE_AFFINE_INFO
#undef FXFUSE_NORM_INFO
#undef FXFUSE_REDUCTION_INFO

const OpInfo* find_op(const std::string& name) {
  for (const OpInfo& op : kOps)
    if (name == op.name) return &op;
  return nullptr;
}

std::string supported_ops() {
  std::string names;
  for (const OpInfo& op : kOps) names += (names.empty() ? "" : ",") + std::string(op.name);
  return names;
}

// ================================================================ parsing (cached per program string)

struct Token {
  enum Kind { Value, Param, Number, None, Bool, String } kind = None;
  int index = 0;       // Value, Param
  double number = 0;   // Number, Bool
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
    const long index = std::strtol(text.c_str() + 1, &end, 10);
    if (end == text.c_str() + 1 || *end != '\0' || index < 0) return false;
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
  token.number = std::strtod(text.c_str(), &end);
  token.kind = Token::Number;
  return *end == '\0';
}

std::shared_ptr<const ParsedProgram> parse_program(const std::string& text) {
  auto program = std::make_shared<ParsedProgram>();
  for (const std::string& item : split(text, ';')) {
    if (item.empty()) continue;
    const size_t open = item.find('(');
    const OpInfo* op = open == std::string::npos ? nullptr : find_op(trim(item.substr(0, open)));
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
  std::vector<at::Tensor> tail_params;  // the params the tail reads, in operand order (after the row result)
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

// Encodes a pointwise attribute token as the functors read it.
bool encode_attribute(const Token& t, float& out) {
  switch (t.kind) {
    case Token::Number:
    case Token::Bool:
      out = static_cast<float>(t.number);
      return true;
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

// True where `dim` is an integer naming the last of `rank` dims (eager raises for one out of range).
bool is_last_dim(const Token& dim, int64_t rank) {
  if (!is_number(dim) || dim.number != std::floor(dim.number)) return false;
  const int64_t d = static_cast<int64_t>(dim.number);
  return d == -1 || d == rank - 1;
}

void set_attribute(Attrs& attrs, size_t index, float value) {
  (index == 0 ? attrs.a0 : index == 1 ? attrs.a1 : attrs.a2) = value;
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

int add_row_param(Binding& b, const RowParam& view) {
  for (size_t i = 0; i < b.row_params.size(); ++i) {
    const RowParam& o = b.row_params[i];
    if (o.ptr == view.ptr && o.row_stride == view.row_stride && o.feature_stride == view.feature_stride)
      return static_cast<int>(i);
  }
  if (b.row_params.size() == static_cast<size_t>(kMaxParams)) return -1;
  b.row_params.push_back(view);
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
  const int index = add_row_param(b, view);
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
          if (!encode_attribute(pi.attrs[a], value)) return "unsupported attribute" + where;
          set_attribute(ins.attrs, a, value);
        }
        if (pi.op->opcode == OP_clamp && std::isnan(ins.attrs.a0) && std::isnan(ins.attrs.a1))
          return "clamp without bounds" + where;
        break;
      case Category::Binary: {
        Shape other_shape;
        if (other->kind == Token::Value) {
          if (!row_phase && other->index < begin) return "the tail reads a value of the row phase" + where;
          other_shape = shapes[other->index];
          const int slot = slots.slot_of(other->index);
          if (other->index != slots.current && slot < 0) return "operand value not kept" + where;
          ins.other = other->index == slots.current ? OTHER_CURRENT : static_cast<uint8_t>(OTHER_SLOT0 + slot);
        } else if (other->kind == Token::Param) {
          if (other->index >= static_cast<int>(ctx.params.size())) return "param out of range" + where;
          other_shape = ctx.params[other->index].sizes().vec();
          ins.other = OTHER_PARAM;
        } else if (is_number(*other)) {
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
            if (!row_param_view(ctx, ctx.params[other->index], out_shape, kind, view))
              return "param $" + std::to_string(other->index) + " has strides that are not (row, feature)" + where;
            const int index = add_row_param(b, view);
            if (index < 0) return "more than " + std::to_string(kMaxParams) + " param uses" + where;
            ins.param[0] = static_cast<int8_t>(index);
          }
        } else if (other->kind == Token::Param) {
          if (b.tail_params.size() + 1 == static_cast<size_t>(kMaxTailOperands))
            return "more than " + std::to_string(kMaxTailOperands - 1) + " params after a broadcast" + where;
          b.tail_params.push_back(ctx.params[other->index]);
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
          if (!is_number(groups) || groups.number < 1 || groups.number != std::floor(groups.number) ||
              ctx.features % static_cast<int64_t>(groups.number) != 0)
            return "num_groups does not divide the features" + where;
          ins.group_size = static_cast<int32_t>(ctx.features / static_cast<int64_t>(groups.number));
        }
        if (kind == NormAttrs::Dim) {
          if (!is_last_dim(pi.attrs[0], static_cast<int64_t>(in_shape.size())))
            return "softmax over a dim other than the last" + where;
        } else if (is_number(eps)) {
          ins.attrs.a0 = static_cast<float>(eps.number);
        } else if (eps.kind == Token::None && kind == NormAttrs::EpsOrDtypeEps) {
          const auto dtype = ctx.x.scalar_type();
          ins.attrs.a0 = dtype == at::kFloat ? std::numeric_limits<float>::epsilon()
                                             : (dtype == at::kBFloat16 ? 0.0078125f : 0.0009765625f);
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
  if (b.row_code.size() + b.tail_code.size() > static_cast<size_t>(kMaxInstructions))
    return "too many instructions after slot moves";
  return "";
}

// ================================================================ launch geometry

struct RowLayout {
  int threads_per_row;
  int rows_per_block;
};

// The fewest threads (a power of 2, from a warp) that hold a row at kRowValues values each; short rows share
// 256-thread blocks.
std::optional<RowLayout> choose_row_layout(int64_t features) {
  int threads = 32;
  while (static_cast<int64_t>(threads) * kRowValues < features && threads < kMaxRowThreads) threads *= 2;
  if (static_cast<int64_t>(threads) * kRowValues < features) return std::nullopt;
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
    } else {
      ins.group_mode = GROUP_SHARED;
      shared_bytes = static_cast<int64_t>(layout.rows_per_block) * features * sizeof(float);
      if (shared_bytes > 48 * 1024) return -1;
    }
  }
  return shared_bytes;
}

// ================================================================ the launcher

// Output dims of the tail with every operand's strides, size-1 dims dropped and mergeable neighbours merged.
bool coalesce_tail(const Shape& out_shape, const std::vector<at::Tensor>& operands, TailProgram& tail) {
  struct Dim {
    int64_t size;
    std::vector<int64_t> strides;
  };
  std::vector<Dim> dims;
  for (size_t d = 0; d < out_shape.size(); ++d) {
    if (out_shape[d] == 1) continue;
    Dim dim{out_shape[d], {}};
    for (const at::Tensor& t : operands) dim.strides.push_back(t.stride(d));
    if (!dims.empty()) {
      Dim& outer = dims.back();
      bool mergeable = true;
      for (size_t k = 0; k < operands.size(); ++k)
        mergeable = mergeable && outer.strides[k] == dim.strides[k] * dim.size;
      if (mergeable) {
        outer.size *= dim.size;
        outer.strides = dim.strides;
        continue;
      }
    }
    dims.push_back(dim);
  }
  if (dims.empty()) dims.push_back(Dim{1, std::vector<int64_t>(operands.size(), 0)});
  if (dims.size() > static_cast<size_t>(kMaxTailDims)) return false;
  tail.ndim = static_cast<int32_t>(dims.size());
  int64_t numel = 1;
  for (size_t d = 0; d < dims.size(); ++d) {
    tail.sizes[d] = static_cast<uint32_t>(dims[d].size);
    numel *= dims[d].size;
  }
  if (numel >= (int64_t{1} << 31)) return false;
  tail.numel = static_cast<uint32_t>(numel);
  const int64_t vec = 16 / operands[0].element_size();
  for (size_t k = 0; k < operands.size(); ++k) {
    int64_t last_offset = 0;
    TailOperand& operand = tail.operands[k];
    operand.ptr = operands[k].data_ptr();
    operand.vector_loads = reinterpret_cast<uintptr_t>(operand.ptr) % 16 == 0 && dims.back().size % vec == 0;
    for (size_t d = 0; d < dims.size(); ++d) {
      operand.strides[d] = static_cast<uint32_t>(dims[d].strides[k]);
      last_offset += (dims[d].size - 1) * dims[d].strides[k];
      const bool innermost = d + 1 == dims.size();
      operand.vector_loads = operand.vector_loads && (innermost ? dims[d].strides[k] == 1 : dims[d].strides[k] % vec == 0);
    }
    if (last_offset >= (int64_t{1} << 31)) return false;
  }
  return true;
}

using FallbackFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::TensorList,
                              c10::string_view, c10::string_view);

at::Tensor run_fallback(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::TensorList params, c10::string_view program, const std::string& reason) {
  static const auto fallback = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("fxfuse::gemm_epilogue_fallback", "")
                                   .typed<FallbackFn>();
  return fallback.call(x, weight, bias, params, program, reason);
}

using Outputs = std::tuple<at::Tensor, at::Tensor>;  // (out, gemm_out) of gemm_epilogue_train
using TrainFallbackFn = Outputs(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::TensorList,
                                c10::string_view, c10::string_view);

Outputs run_train_fallback(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           at::TensorList params, c10::string_view program, const std::string& reason) {
  static const auto fallback = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("fxfuse::gemm_epilogue_train_fallback", "")
                                   .typed<TrainFallbackFn>();
  return fallback.call(x, weight, bias, params, program, reason);
}

// Why the kernels cannot take these tensors, or "".
std::string check_inputs(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::TensorList params) {
  const auto dtype = x.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf)
    return std::string("dtype ") + c10::toString(dtype);
  if (x.dim() < 2) return "x has fewer than 2 dims";
  if (weight.dim() != 2 || weight.size(1) != x.size(-1)) return "weight does not match x";
  if (x.numel() == 0 || weight.size(0) == 0) return "empty input";
  if (!x.is_contiguous() || !weight.is_contiguous()) return "x or weight is not contiguous";
  std::vector<const at::Tensor*> tensors{&weight};
  if (bias.has_value()) {
    if (bias->dim() != 1 || bias->size(0) != weight.size(0) || !bias->is_contiguous()) return "bias is not [N]";
    tensors.push_back(&*bias);
  }
  for (const at::Tensor& p : params) tensors.push_back(&p);
  for (const at::Tensor* t : tensors) {
    if (t->scalar_type() != dtype) return "dtypes differ";
    if (t->device() != x.device()) return "devices differ";
  }
  return "";
}

// The row kernel (with or without slots) and the broadcast tail, where the program has them.
template <class Storage>
void launch(const Binding& binding, const RowProgram& row, const std::optional<RowLayout>& layout,
            int64_t shared_bytes, const TailProgram& tail, cudaStream_t stream) {
  if (!binding.row_code.empty()) {
    const RowLaunch row_launch{layout->rows_per_block, shared_bytes};
    const bool general = needs_general_row_kernel(row);
    if (binding.slots_used > 0) {
      if (general) launch_row_program<Storage, kMaxSlots, true>(row, row_launch, stream);
      else launch_row_program<Storage, kMaxSlots, false>(row, row_launch, stream);
    } else {
      if (general) launch_row_program<Storage, 0, true>(row, row_launch, stream);
      else launch_row_program<Storage, 0, false>(row, row_launch, stream);
    }
  }
  if (binding.has_tail) launch_broadcast_tail<Storage>(tail, stream);
}

// The fused op: (out, an undefined tensor), or with keep_gemm_output (gemm_epilogue_train) (out, y), where the
// epilogue writes a tensor of its own instead of y.
Outputs run_gemm_epilogue(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          at::TensorList params, c10::string_view program_text, bool keep_gemm_output) {
  const auto fallback = [&](const std::string& why) -> Outputs {
    if (keep_gemm_output) return run_train_fallback(x, weight, bias, params, program_text, why);
    return {run_fallback(x, weight, bias, params, program_text, why), at::Tensor()};
  };
  std::string reason = check_inputs(x, weight, bias, params);
  if (!reason.empty()) return fallback(reason);
  const auto program = cached_program(std::string(program_text));
  if (!program->error.empty()) return fallback(program->error);

  const c10::cuda::CUDAGuard device_guard(x.device());
  const int64_t features = weight.size(0);
  const int64_t in_features = x.size(-1);
  const int vec = static_cast<int>(16 / x.element_size());
  Context ctx{*program, x, params, x.sizes().vec(), {}, features, vec};
  ctx.lead.pop_back();
  ctx.full = ctx.lead;
  ctx.full.push_back(features);
  const int64_t rows = x.numel() / in_features;

  Binding binding;
  reason = bind(ctx, binding);
  if (!reason.empty()) return fallback(reason);

  std::optional<RowLayout> layout;
  int64_t shared_bytes = 0;
  if (!binding.row_code.empty()) {
    layout = choose_row_layout(features);
    if (!layout) return fallback("rows too long for registers");
    shared_bytes = place_groups(binding.row_code, *layout, vec, features);
    if (shared_bytes < 0) return fallback("group layout needs > 48 KB");
  }

  // The GEMM: ATen, so cuBLAS and torch's precision flags exactly as eager.
  const at::Tensor y = at::linear(x.view({rows, in_features}), weight, bias);
  at::Tensor row_result = y;

  RowProgram row{};
  if (!binding.row_code.empty()) {
    std::copy(binding.row_code.begin(), binding.row_code.end(), row.code);
    std::copy(binding.row_params.begin(), binding.row_params.end(), row.params);
    row.num_instructions = static_cast<int32_t>(binding.row_code.size());
    row.input = y.data_ptr();
    row.output_per_row = binding.row_result_kind != RowShape::Full;
    if (row.output_per_row) row_result = at::empty({rows}, y.options());
    else if (keep_gemm_output) row_result = at::empty_like(y);  // y is returned: the rows go elsewhere
    row.output = row_result.data_ptr();
    row.rows = rows;
    row.features = static_cast<int32_t>(features);
    row.threads_per_row = layout->threads_per_row;
    row.group_shared_floats = static_cast<int32_t>(shared_bytes / sizeof(float));
    row.vector_io = features % vec == 0;
  }

  at::Tensor output;
  TailProgram tail{};
  if (binding.has_tail) {
    output = at::empty(binding.output_shape, y.options());
    std::vector<at::Tensor> operands{row_result.view(binding.row_result_shape).expand(binding.output_shape)};
    for (const at::Tensor& param : binding.tail_params) operands.push_back(param.expand(binding.output_shape));
    tail.num_operands = static_cast<int32_t>(operands.size());
    while (operands.size() < static_cast<size_t>(kMaxTailOperands)) operands.push_back(operands[0]);
    if (!coalesce_tail(binding.output_shape, operands, tail))
      return fallback("broadcast output too large or too many dims");
    std::copy(binding.tail_code.begin(), binding.tail_code.end(), tail.code);
    tail.num_instructions = static_cast<int32_t>(binding.tail_code.size());
    tail.output = output.data_ptr();
  } else {
    // An empty program's result is y itself: the training op returns a copy beside it.
    output = (keep_gemm_output && binding.row_code.empty() ? y.clone() : row_result).view(binding.output_shape);
  }

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (x.scalar_type() == at::kFloat) launch<Fp32Storage>(binding, row, layout, shared_bytes, tail, stream);
  else if (x.scalar_type() == at::kBFloat16) launch<Bf16Storage>(binding, row, layout, shared_bytes, tail, stream);
  else launch<Fp16Storage>(binding, row, layout, shared_bytes, tail, stream);
  return {output, keep_gemm_output ? y.view(ctx.full) : at::Tensor()};
}

at::Tensor gemm_epilogue_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              at::TensorList params, c10::string_view program_text) {
  return std::get<0>(run_gemm_epilogue(x, weight, bias, params, program_text, false));
}

Outputs gemm_epilogue_train_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 at::TensorList params, c10::string_view program_text) {
  return run_gemm_epilogue(x, weight, bias, params, program_text, true);
}

}  // namespace
}  // namespace fxfuse

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  m.def("cuda_supported_ops() -> str", [] { return fxfuse::supported_ops(); });
}

TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) {
  m.impl("gemm_epilogue", &fxfuse::gemm_epilogue_cuda);
  m.impl("gemm_epilogue_train", &fxfuse::gemm_epilogue_train_cuda);
}
