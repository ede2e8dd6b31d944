// SPDX-License-Identifier: Apache-2.0
//
// Registration only: every ibpembed op schema, the CPU implementations (codec_ops.cpp,
// layout_ops.cpp, lookup_ops.cpp), the CUDA implementations in CUDA builds
// (lookup_ops_cuda.cpp), and the Python module's process-level controls. Python code calls
// torch.ops.ibpembed.* on every build without branching; the dispatcher picks the backend from
// the tensors' devices.
//
// The argument order of a compressed table is in ops.h. lookup_pooled_tables reads several
// tables in one call: they are registered once in a TableSet (torch.classes.ibpembed.TableSet),
// each with the same tensors and ints, then its dtype code.
#include <torch/extension.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <utility>

#include "ibpembed/codec.h"
#include "ibpembed/lookup.h"
#include "ibpembed/numeric.h"
#include "ibpembed/tier.h"
#include "mapping_guard.h"
#include "op_checks.h"
#include "ops.h"

namespace ibpembed {

TORCH_LIBRARY(ibpembed, m) {
  m.def("ibp_fit(Tensor sample, int chunk_bits, str method, int code_bits=1) -> (Tensor, Tensor)");
  // The codebook fits of several code widths at once: [mask, bitval] per width, in order.
  m.def("ibp_fit_codebooks(Tensor sample, int chunk_bits, int[] code_bits) -> Tensor[]");
  m.def(
      "ibp_slot_bytes(Tensor rows, int chunk_bits, Tensor mask, Tensor bitval, int unit_bytes) "
      "-> Tensor");
  m.def(
      "ibp_compress(Tensor rows, int chunk_bits, Tensor mask, Tensor bitval, int unit_bytes) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // A compressed table's payload, block_base and row_units with each slot moved to the next
  // 32-byte boundary where that lowers the 128-byte lines it touches (pack --for-gpu).
  m.def(
      "ibp_line_aware(Tensor payload, Tensor block_base, Tensor row_units, int row_bytes, "
      "int unit_bytes, int num_rows) -> (Tensor, Tensor, Tensor)");
  m.def(
      "ibp_decompress(Tensor payload, Tensor block_base, Tensor row_units, Tensor bitmask, "
      "Tensor mask, Tensor bitval, int chunk_bits, int row_bytes, int unit_bytes, int num_rows) "
      "-> Tensor");
  m.def(
      "ibp_gather(Tensor payload, Tensor block_base, Tensor row_units, Tensor bitmask, "
      "Tensor mask, Tensor bitval, int chunk_bits, int row_bytes, int unit_bytes, int num_rows, "
      "Tensor indices, Tensor? tier_dir=None, Tensor? tier_rows=None) -> Tensor");
  m.def(
      "lookup_pooled(Tensor payload, Tensor block_base, Tensor row_units, Tensor bitmask, "
      "Tensor mask, Tensor bitval, int chunk_bits, int row_bytes, int unit_bytes, int num_rows, "
      "Tensor indices, Tensor offsets, Tensor? per_sample_weights, int dtype, int pooling, "
      "Tensor? tier_dir=None, Tensor? tier_rows=None) -> Tensor");
  m.class_<TableSet>("TableSet").def(torch::init<>()).def("add", &TableSet::add);
  m.def(
      "lookup_pooled_tables(__torch__.torch.classes.ibpembed.TableSet tables, Tensor indices, "
      "Tensor offsets, Tensor table_bags, Tensor? per_sample_weights, int pooling) "
      "-> (Tensor[], Tensor)");
}

TORCH_LIBRARY_IMPL(ibpembed, CPU, m) {
  m.impl("ibp_fit", &ibp_fit_cpu);
  m.impl("ibp_fit_codebooks", &ibp_fit_codebooks_cpu);
  m.impl("ibp_slot_bytes", &ibp_slot_bytes_cpu);
  m.impl("ibp_compress", &ibp_compress_cpu);
  m.impl("ibp_line_aware", &ibp_line_aware_cpu);
  m.impl("ibp_decompress", &ibp_decompress_cpu);
  m.impl("ibp_gather", &ibp_gather_cpu);
  m.impl("lookup_pooled", &lookup_pooled_cpu_op);
  m.impl("lookup_pooled_tables", &lookup_pooled_tables_cpu);
}

#ifdef IBPEMBED_WITH_CUDA
// The HBM tier's ops exist in CUDA builds only (a tier lives in GPU memory).
TORCH_LIBRARY_FRAGMENT(ibpembed, m) {
  m.def(
      "ibp_gather_hbm(Tensor payload, Tensor block_base, Tensor row_units, Tensor bitmask, "
      "Tensor mask, Tensor bitval, int chunk_bits, int row_bytes, int unit_bytes, int num_rows, "
      "Tensor indices, Tensor tier_dir, Tensor? tier_slot_offset, Tensor tier_payload, "
      "int tier_slots, Tensor tier_counters) -> Tensor");
  m.class_<gpu::TierSet>("TierSet")
      .def(torch::init<>())
      .def("add", &gpu::TierSet::add)
      .def("upload", &gpu::TierSet::upload);
  m.def(
      "lookup_pooled_tables_hbm(__torch__.torch.classes.ibpembed.TableSet tables, "
      "__torch__.torch.classes.ibpembed.TierSet tiers, Tensor indices, Tensor offsets, "
      "Tensor table_bags, Tensor? per_sample_weights, int pooling) -> (Tensor[], Tensor)");
}

TORCH_LIBRARY_IMPL(ibpembed, CUDA, m) {
  m.impl("ibp_gather_hbm", &gpu::ibp_gather_hbm_cuda);
  m.impl("lookup_pooled_tables_hbm", &gpu::lookup_pooled_tables_hbm_cuda);
  m.impl("ibp_decompress", &gpu::ibp_decompress_cuda);
  m.impl("ibp_gather", &gpu::ibp_gather_cuda);
  m.impl("lookup_pooled", &gpu::lookup_pooled_cuda);
  m.impl("lookup_pooled_tables", &gpu::lookup_pooled_tables_cuda);
}
#endif

}  // namespace ibpembed

// The Python module carries process-level controls, the layout's constants and a non-raising
// form of the ops' table checks; all table work goes through torch.ops.
PYBIND11_MODULE(_C, module) {
  module.doc() = "ibpembed native ops (registered under torch.ops.ibpembed)";
  // The layout's constants, so Python reads them from the header instead of repeating them.
  module.attr("FORMAT_VERSION") = ibpembed::kFormatVersion;
  module.attr("ROWS_PER_BLOCK") = ibpembed::kRowsPerBlock;
  module.attr("PAYLOAD_PAD") = ibpembed::kPayloadPad;
  module.attr("MAX_UNITS_PER_ROW") = ibpembed::kMaxUnitsPerRow;
  module.attr("MAX_SLOT_UNIT") = ibpembed::kMaxSlotUnit;
  module.attr("TIER_WORD_ROWS") = ibpembed::kTierWordRows;
  module.attr("MAX_ROW_BYTES") = ibpembed::kMaxRowBytes;
  module.attr("INT8_ROWWISE_HEADER_BYTES") = ibpembed::kInt8RowwiseHeaderBytes;
  module.attr("DTYPE_FLOAT32") = static_cast<int>(ibpembed::DType::kFloat32);
  module.attr("DTYPE_FLOAT16") = static_cast<int>(ibpembed::DType::kFloat16);
  module.attr("DTYPE_BFLOAT16") = static_cast<int>(ibpembed::DType::kBFloat16);
  module.attr("DTYPE_UINT8") = static_cast<int>(ibpembed::DType::kUInt8);
  module.attr("DTYPE_INT8") = static_cast<int>(ibpembed::DType::kInt8);
  module.attr("DTYPE_INT8_ROWWISE") = static_cast<int>(ibpembed::DType::kInt8Rowwise);
  module.attr("POOLING_SUM") = static_cast<int>(ibpembed::Pooling::kSum);
  module.attr("POOLING_MEAN") = static_cast<int>(ibpembed::Pooling::kMean);
  module.def(
      "table_shape_problem",
      [](const at::Tensor& block_base, const at::Tensor& row_units, const at::Tensor& bitmask,
         const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits, int64_t row_bytes,
         int64_t unit_bytes,
         int64_t num_rows) -> std::optional<std::pair<std::string, std::string>> {
        try {
          ibpembed::check_table_shapes(block_base, row_units, bitmask, mask, bitval, chunk_bits,
                                       row_bytes, unit_bytes, num_rows);
        } catch (const ibpembed::TableArgError& e) {
          return std::make_pair(std::string(e.arg()), e.msg());
        }
        return std::nullopt;
      },
      pybind11::arg("block_base"), pybind11::arg("row_units"), pybind11::arg("bitmask"),
      pybind11::arg("mask"), pybind11::arg("bitval"), pybind11::arg("chunk_bits"),
      pybind11::arg("row_bytes"), pybind11::arg("unit_bytes"), pybind11::arg("num_rows"),
      "The first table argument the ops' shape checks reject (op_checks.h check_table_shapes), "
      "as (argument, message); None when every check passes.");
  module.def(
      "cpu_path", [] { return std::string(ibpembed::cpu_path_name(ibpembed::active_cpu_path())); },
      "The CPU codec path in use: 'avx512', 'bmi2' or 'ref'.");
  module.def("cpu_has_bmi2", &ibpembed::cpu_has_bmi2, "Whether this CPU reports BMI2.");
  module.def("cpu_has_avx512", &ibpembed::cpu_has_avx512,
             "Whether this CPU runs the AVX-512 path (BMI2, AVX-512 F/BW/VBMI/VBMI2).");
  module.def("cpu_has_microcoded_pdep", &ibpembed::cpu_has_microcoded_pdep,
             "Whether this CPU runs pdep/pext in microcode (AMD Zen 1/2).");
  module.def(
      "default_cpu_path",
      [] { return std::string(ibpembed::cpu_path_name(ibpembed::default_cpu_path())); },
      "The path chosen when IBPEMBED_CPU_PATH is unset.");
  module.def(
      "set_cpu_path",
      [](const std::string& name) {
        ibpembed::CpuPath path;
        TORCH_CHECK_VALUE(ibpembed::cpu_path_from_name(name.c_str(), &path),
                          "cpu path must be 'ref', 'bmi2' or 'avx512', got '", name, "'");
        ibpembed::set_active_cpu_path(path);
      },
      "Switch the CPU codec path for this process (tests and benchmarks).");
  module.def(
      "pool_loops", [] { return std::string(ibpembed::pool_loops_name()); },
      "The pooling loops pooled CPU lookups run: 'avx512', 'avx2' or 'portable'.");
  module.def("available_pool_loops", &ibpembed::available_pool_loops,
             "The pooling loops this CPU runs, widest (the default) first.");
  module.def(
      "set_pool_loops",
      [](const std::string& name) {
        TORCH_CHECK_VALUE(ibpembed::set_pool_loops(name), "pool loops must be one of this CPU's ",
                          "(available_pool_loops()), got '", name, "'");
      },
      "Switch the pooling loops for this process (tests: every loop checked on one host).");
  module.def(
      "pattern_lookup",
      [] { return std::string(ibpembed::pattern_lookup_name(ibpembed::active_pattern_lookup())); },
      "How the avx512 path's codebook decoder finds patterns: 'gather' or 'tables'.");
  module.def(
      "default_pattern_lookup",
      [] { return std::string(ibpembed::pattern_lookup_name(ibpembed::default_pattern_lookup())); },
      "The pattern lookup chosen when IBPEMBED_PATTERN_LOOKUP is unset.");
  module.def(
      "set_pattern_lookup",
      [](const std::string& name) {
        ibpembed::PatternLookup lookup;
        TORCH_CHECK_VALUE(ibpembed::pattern_lookup_from_name(name.c_str(), &lookup),
                          "pattern lookup must be 'gather' or 'tables', got '", name, "'");
        ibpembed::set_active_pattern_lookup(lookup);
      },
      "Switch the avx512 decoder's pattern lookup for this process (tests and benchmarks).");
  module.def("stage_min_bytes", &ibpembed::stage_min_bytes,
             "Payload bytes above which CPU lookups stage rows instead of prefetching them.");
  module.def("default_stage_min_bytes", &ibpembed::default_stage_min_bytes,
             "stage_min_bytes without IBPEMBED_STAGE_MIN_BYTES: the last-level cache's size.");
  module.def(
      "set_stage_min_bytes",
      [](int64_t bytes) {
        TORCH_CHECK_VALUE(bytes >= 0, "stage_min_bytes must be >= 0, got ", bytes);
        ibpembed::set_stage_min_bytes(bytes);
      },
      "Set stage_min_bytes for this process (tests and benchmarks).");
  module.def(
      "set_served_payload_bytes",
      [](int64_t bytes) {
        TORCH_CHECK_VALUE(bytes >= 0, "served payload bytes must be >= 0, got ", bytes);
        ibpembed::set_served_payload_bytes(bytes);
      },
      "Size stage_min_bytes for a process serving this many payload bytes from the CPU.");
  module.def("install_mapping_guard", &ibpembed::install_mapping_guard,
             "Install the SIGBUS handler of guarded table-file mappings (once per process).");
  module.def(
      "guard_mapping",
      [](uintptr_t begin, uint64_t bytes) { return ibpembed::guard_mapping(begin, bytes); },
      pybind11::arg("begin"), pybind11::arg("bytes"),
      "Guard a mapped range against SIGBUS; returns its slot (-1: no slot free).");
  module.def("unguard_mapping", &ibpembed::unguard_mapping, pybind11::arg("slot"),
             "Stop guarding a slot's range (before it is unmapped).");
  module.def(
      "mapping_faults_at", [](uintptr_t address) { return ibpembed::mapping_faults_at(address); },
      pybind11::arg("address"), "Faults absorbed in the guarded range holding an address.");
  module.def("mapping_faults_total", &ibpembed::mapping_faults_total,
             "Faults absorbed in every guarded range since the process started.");
#ifdef IBPEMBED_WITH_CUDA
  module.def("host_mapped_alias", &ibpembed::gpu::host_mapped_alias, pybind11::arg("host"),
             pybind11::arg("read_only"), pybind11::arg("device_index"),
             "Register a host buffer in place (cudaHostRegister) and return its device alias.");
  module.def("set_defer_cuda_errors", &ibpembed::gpu::set_defer_errors, pybind11::arg("defer"),
             "Report this thread's CUDA op errors at the next call or check_cuda_errors() "
             "instead of synchronising in every call.");
  module.def("check_cuda_errors", &ibpembed::gpu::check_errors,
             "Synchronise the current CUDA stream and raise what its deferred ops found.");
  module.def("host_register_read_only_supported", &ibpembed::gpu::host_register_read_only_supported,
             pybind11::arg("device_index"),
             "Whether the GPU takes cudaHostRegisterReadOnly registrations.");
#endif
}
