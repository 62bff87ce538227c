// pybind11 module shmgrad._C: the C++ trainer API for Python. Tensors cross the
// boundary as torch.Tensor (the extension and Python's torch share one libtorch).
// The public, documented surface is the pure-Python package (python/shmgrad).
#include <pybind11/chrono.h>
#include <torch/extension.h>

#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/process_group.h"
#include "engine/control.h"
#include "engine/model_file.h"
#include "engine/placement.h"
#include "engine/serve_options.h"
#include "engine/trainer.h"
#include "gpu/cuda_library.h"
#include "ipc/device_table.h"
#include "ipc/error.h"
#include "ipc/layout.h"
#include "ipc/reduce.h"
#include "ipc/segment.h"
#include "views/segment_views.h"

namespace py = pybind11;

namespace {

// engine::EngineStatus as a dict: keys are the struct's field names, `workers` and
// `recent_steps` lists of dicts keyed by WorkerStatus's and StepSummary's field names.
// Records to Python, from their field lists (ipc/record.h): a status record becomes a
// dict keyed by field name; _C.RECORDS describes every record for the Python classes.
template <typename T>
py::object toPython(const T& v) {
  return py::cast(v);
}
py::dict toPython(const shmgrad::engine::WorkerStatus& s);
py::dict toPython(const shmgrad::engine::StepSummary& s);
template <typename T>
py::object toPython(const std::vector<T>& v) {
  py::list out;
  for (const auto& x : v) out.append(toPython(x));
  return out;
}
#define SHMGRAD_FIELD_TO_DICT(type, name, comment) d[#name] = toPython(s.name);
py::dict toPython(const shmgrad::engine::WorkerStatus& s) {
  py::dict d;
  SHMGRAD_WORKER_STATUS_FIELDS(SHMGRAD_FIELD_TO_DICT)
  return d;
}
py::dict toPython(const shmgrad::engine::StepSummary& s) {
  py::dict d;
  SHMGRAD_STEP_SUMMARY_FIELDS(SHMGRAD_FIELD_TO_DICT)
  return d;
}
py::dict statusToDict(const shmgrad::engine::EngineStatus& s) {
  py::dict d;
  SHMGRAD_ENGINE_STATUS_FIELDS(SHMGRAD_FIELD_TO_DICT)
  return d;
}

// A field's Python type, by name: int, float, bool, str, or list of a record.
template <typename T>
const char* pyTypeName() {
  if constexpr (std::is_same_v<T, bool>) return "bool";
  if constexpr (std::is_integral_v<T> || std::is_enum_v<T>) return "int";
  if constexpr (std::is_floating_point_v<T>) return "float";
  if constexpr (std::is_same_v<T, std::string>) return "str";
  if constexpr (std::is_same_v<T, std::vector<shmgrad::engine::WorkerStatus>>)
    return "list:WorkerStatus";
  if constexpr (std::is_same_v<T, std::vector<shmgrad::engine::StepSummary>>)
    return "list:StepSummary";
  if constexpr (std::is_same_v<T, std::vector<shmgrad::WorkerStepStats>>)
    return "list:WorkerStepStats";
  if constexpr (std::is_same_v<T, std::vector<int>>) return "list:int";
  return "object";
}
#define SHMGRAD_FIELD_DESCRIPTION(type, name, comment) \
  fields.append(py::make_tuple(#name, pyTypeName<type>(), comment));
#define SHMGRAD_DESCRIBE_RECORD(record, FIELDS) \
  {                                             \
    py::list fields;                            \
    FIELDS(SHMGRAD_FIELD_DESCRIPTION)           \
    records[record] = fields;                   \
  }
py::dict recordDescriptions() {
  py::dict records;
  SHMGRAD_DESCRIBE_RECORD("WorkerStatus", SHMGRAD_WORKER_STATUS_FIELDS)
  SHMGRAD_DESCRIBE_RECORD("StepSummary", SHMGRAD_STEP_SUMMARY_FIELDS)
  SHMGRAD_DESCRIBE_RECORD("EngineStatus", SHMGRAD_ENGINE_STATUS_FIELDS)
  SHMGRAD_DESCRIBE_RECORD("WorkerStepStats", SHMGRAD_WORKER_STEP_STATS_FIELDS)
  SHMGRAD_DESCRIBE_RECORD("GradientStats", SHMGRAD_GRADIENT_STATS_FIELDS)
  return records;
}

// The loss names the engine accepts (ipc::kLossNames, whose index 0 is no loss).
py::list lossNames() {
  py::list names;
  for (const char* name : shmgrad::ipc::kLossNames) {
    if (name != nullptr) names.append(name);
  }
  return names;
}

// Each loss name's torch.nn.functional function (ipc::kLossFunctions).
py::dict lossFunctions() {
  py::dict functions;
  for (uint32_t i = 1; i <= shmgrad::ipc::kNumLossKinds; ++i) {
    functions[shmgrad::ipc::kLossNames[i]] = shmgrad::ipc::kLossFunctions[i];
  }
  return functions;
}

// Options to Python, from their lists (engine/trainer.h, engine/serve_options.h): each
// field crosses the binding as its own type, an enum as its underlying integer, by field name
// and in its list's order; _C.*_OPTIONS describes each list as (name, type, default, doc,
// ...) tuples, the default as Python sees it.
template <typename T, bool = std::is_enum_v<T>>
struct Wire {
  using type = T;
};
template <typename T>
struct Wire<T, true> {
  using type = std::underlying_type_t<T>;
};
template <typename T>
using WireType = typename Wire<T>::type;

// A lambda's parameter, its assignment into the options struct `options`, and its py::arg
// with the struct's default (GradientOptions', AttachOptions').
#define SHMGRAD_OPTION_PARAMETER(type, name, ...) , WireType<type> name
#define SHMGRAD_OPTION_FROM_PARAMETER(type, name, ...) options.name = static_cast<type>(name);
#define SHMGRAD_GRADIENT_OPTION_ARG(type, name, ...) \
  , py::arg(#name) = static_cast<WireType<type>>(shmgrad::GradientOptions{}.name)
#define SHMGRAD_ATTACH_OPTION_ARG(type, name, ...) \
  , py::arg(#name) = static_cast<WireType<type>>(shmgrad::AttachOptions{}.name)

// (name, type, default, doc) of the gradient and attach lists; (name, type, default, doc,
// flag, internal) of serve's, whose internal options are the launchers' (hidden in --help).
#define SHMGRAD_OPTION_DESCRIPTION(type, name, default_value, doc) \
  fields.append(py::make_tuple(#name, pyTypeName<type>(),          \
                               py::cast(static_cast<WireType<type>>(Defaults{}.name)), doc));
#define SHMGRAD_SERVE_USER_OPTION(type, name, default_value, flag, doc) \
  fields.append(                                                        \
      py::make_tuple(#name, pyTypeName<type>(), py::cast(Defaults{}.name), doc, flag, false));
#define SHMGRAD_SERVE_LAUNCHER_OPTION(type, name, default_value, flag, doc) \
  fields.append(                                                            \
      py::make_tuple(#name, pyTypeName<type>(), py::cast(Defaults{}.name), doc, flag, true));

py::list gradientOptionDescriptions() {
  using Defaults = shmgrad::GradientOptions;
  py::list fields;
  SHMGRAD_GRADIENT_OPTIONS_FIELDS(SHMGRAD_OPTION_DESCRIPTION)
  return fields;
}

py::list attachOptionDescriptions() {
  using Defaults = shmgrad::AttachOptions;
  py::list fields;
  SHMGRAD_ATTACH_OPTIONS_FIELDS(SHMGRAD_OPTION_DESCRIPTION)
  return fields;
}

py::list serveOptionDescriptions() {
  using Defaults = shmgrad::engine::ServeOptions;
  py::list fields;
  SHMGRAD_SERVE_USER_OPTIONS(SHMGRAD_SERVE_USER_OPTION)
  SHMGRAD_SERVE_LAUNCHER_OPTIONS(SHMGRAD_SERVE_LAUNCHER_OPTION)
  return fields;
}

}  // namespace

namespace shmgrad {
void bindEagerWorker(py::module_& m);                          // python/worker_binding.cc
Trainer::InTrainerStep inTrainerStep(py::handle participant);  // python/worker_binding.cc
}  // namespace shmgrad

#ifndef SHMGRAD_CUDA_TOOLKIT
#define SHMGRAD_CUDA_TOOLKIT ""  // nvcc's release when the CUDA path is built (CMakeLists.txt)
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "shmgrad native module (use the shmgrad package instead)";

  // What this module was compiled against (shmgrad.build_info() adds the Python side).
  m.def("build_info", [] {
    py::dict d;
    d["torch"] = TORCH_VERSION;
    d["cxx11_abi"] = static_cast<bool>(_GLIBCXX_USE_CXX11_ABI);
    // The CUDA path (libshmgrad_cuda.so beside this module), when nvcc built it.
    const std::string toolkit = SHMGRAD_CUDA_TOOLKIT;
    d["cuda"] = !toolkit.empty();
    d["cuda_toolkit"] = toolkit.empty() ? py::object(py::none()) : py::object(py::str(toolkit));
    d["compiler"] = __VERSION__;
    return d;
  });

  // Each worker slot's device index among an engine's devices (ipc/device_table.h).
  m.def(
      "place_round_robin",
      [](uint32_t slots, uint32_t devices) {
        return shmgrad::ipc::placeRoundRobin(slots, devices).device;
      },
      py::arg("slots"), py::arg("devices"));

  // The GPUs libshmgrad_cuda.so at `path` sees, or the error naming what is missing: the
  // coordinator's own check (gpu/cuda_library.h), for the Python API before it starts one.
  m.def(
      "cuda_device_count",
      [](const std::string& path) { return shmgrad::gpu::CudaLibrary::load(path)->deviceCount(); },
      py::arg("path"));
  m.attr("CUDA_API_VERSION") = SHMGRAD_CUDA_API_VERSION;

  // shmgrad::Error -> shmgrad.errors.<class for its kind>, resolved at raise time.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const shmgrad::Error& e) {
      py::gil_scoped_acquire gil;
      py::object errors = py::module_::import("shmgrad.errors");
      py::object cls = errors.attr("error_class")(shmgrad::errorKindName(e.kind()));
      py::object exc = cls(py::str(e.what()));
      // A worker's failure says which worker and the type of what it raised.
      exc.attr("worker") = e.worker() >= 0 ? py::object(py::int_(e.worker())) : py::none();
      exc.attr("error_type") =
          e.errorType().empty() ? py::none() : py::object(py::str(e.errorType()));
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });

  // One gradient call's statistics, moved out of the call as they are: nothing is
  // converted until Python reads a field (shmgrad.GradientStats is the public view).
  using Stats = shmgrad::GradientStats;
  using WorkerStats = shmgrad::WorkerStepStats;
#define SHMGRAD_DEF_READONLY(type, name, comment) .def_readonly(#name, &Record::name)
  {
    using Record = WorkerStats;
    py::class_<Record>(m, "NativeWorkerStats")
        SHMGRAD_WORKER_STEP_STATS_FIELDS(SHMGRAD_DEF_READONLY);
  }
  {
    using Record = Stats;
    // Default-constructed: the statistics of no step (a node whose share was empty).
    py::class_<Record>(m, "NativeStats")
        .def(py::init<>()) SHMGRAD_GRADIENT_STATS_FIELDS(SHMGRAD_DEF_READONLY);
  }
  m.attr("RECORDS") = recordDescriptions();
  m.attr("GRADIENT_OPTIONS") = gradientOptionDescriptions();
  m.attr("ATTACH_OPTIONS") = attachOptionDescriptions();
  m.attr("SERVE_OPTIONS") = serveOptionDescriptions();
  m.def("physical_cores", &shmgrad::engine::physicalCores,
        "CPUs this process may run on, each physical core counted once (engine/placement.h)");
  m.def(
      "auto_workers",
      [](uint32_t max_workers) { return shmgrad::engine::autoStart(max_workers).workers; },
      py::arg("max_workers"), "the workers serve --workers auto starts (0: no bound)");

  py::class_<shmgrad::Trainer>(m, "Trainer")
      .def_static(
          "attach",
          [](const std::string& name SHMGRAD_ATTACH_OPTIONS_FIELDS(SHMGRAD_OPTION_PARAMETER)) {
            shmgrad::AttachOptions options;
            SHMGRAD_ATTACH_OPTIONS_FIELDS(SHMGRAD_OPTION_FROM_PARAMETER)
            py::gil_scoped_release nogil;
            return shmgrad::Trainer::attach(name, options);
          },
          py::arg("name") SHMGRAD_ATTACH_OPTIONS_FIELDS(SHMGRAD_ATTACH_OPTION_ARG))
      .def_property_readonly("device", &shmgrad::Trainer::device,
                             "the CUDA device its views are on, or -1 (a CPU engine)")
      .def_property_readonly("on_device", &shmgrad::Trainer::onDevice,
                             "whether its views are of the engine's device memory (an "
                             "engine with devices, also on a test double's host memory)")
      .def("parameters",
           [](const shmgrad::Trainer& t) {
             py::list out;
             for (const auto& p : t.parameters()) {
               out.append(py::make_tuple(p.name, p.shape,
                                         shmgrad::ipc::memoryFormatName(p.memory_format)));
             }
             return out;
           })
      .def("parameter_views", &shmgrad::Trainer::parameterViews)
      .def("gradient_views", &shmgrad::Trainer::gradientViews)
      .def("parameter_buffer", &shmgrad::Trainer::parameterBuffer)
      .def("buffer_views", &shmgrad::Trainer::bufferViews)
      .def("buffer_block", &shmgrad::Trainer::bufferBlock,
           "the shared buffers' region as one uint8 tensor")
      .def("buffer_views_of", &shmgrad::Trainer::bufferViewsOf, py::arg("block"),
           "views of the buffers over a uint8 tensor laid out as that region")
      .def("gradient_buffer", &shmgrad::Trainer::gradientBuffer)
      .def("accumulator_views", &shmgrad::Trainer::accumulatorViews)
      .def("dataset_size", &shmgrad::Trainer::datasetSize)
      .def("loss_reduction", &shmgrad::Trainer::lossReduction)
      .def("worker_count", &shmgrad::Trainer::workerCount)
      .def("cores", &shmgrad::Trainer::cores)
      .def("set_placement", &shmgrad::Trainer::setPlacement, py::arg("workers"), py::arg("threads"),
           py::arg("in_trainer") = false)
      .def("has_trainer_slot", &shmgrad::Trainer::hasTrainerSlot)
      .def(
          "worker_kind",
          [](const shmgrad::Trainer& t) {
            return std::string(shmgrad::ipc::workerKindName(
                static_cast<shmgrad::ipc::WorkerKind>(t.segment().header()->worker_kind)));
          },
          "the engine's workers: \"script\" (TorchScript) or \"eager\"")
      .def(
          "set_in_trainer",
          [](shmgrad::Trainer& t, py::handle participant) {
            t.setInTrainer(shmgrad::inTrainerStep(participant));
          },
          py::arg("participant"),
          "steps of the in-trainer placement run participant's compute (the trainer slot's "
          "_C.StepParticipant, prepared, or a _C.ScriptInTrainer; kept alive by the caller "
          "while this trainer lives)")
      .def("placement",
           [](const shmgrad::Trainer& t) {
             const shmgrad::PlacementStatus p = t.placement();
             py::list probe;
             for (const auto& c : p.probe) {
               py::dict d;
               d["workers"] = c.workers;
               d["threads_per_worker"] = c.threads;
               d["ms_per_example"] = c.seconds_per_example * 1e3;
               d["steps"] = c.samples;
               d["in_trainer"] = c.in_trainer;
               probe.append(d);
             }
             py::dict d;
             d["auto"] = p.automatic;
             d["state"] = p.state;
             d["workers"] = p.workers;
             d["threads_per_worker"] = p.threads;
             d["in_trainer"] = p.in_trainer;
             d["probe"] = probe;
             d["report"] = p.report;
             d["rechecks"] = p.rechecks;
             return d;
           })
      .def("slot_count", &shmgrad::Trainer::slotCount)
      .def("coordinator_pid", &shmgrad::Trainer::coordinatorPid)
      .def("closed", &shmgrad::Trainer::closed)
      .def("close", &shmgrad::Trainer::close)
      // The gradient of one batch: `indices` into the engine's dataset, or `inputs` and
      // `targets`; then every GradientOptions field, positional in its list's order
      // (_C.GRADIENT_OPTIONS: Python's Client.gradient builds the tuple in that order).
      .def(
          "gradient",
          [](shmgrad::Trainer& t, std::optional<at::Tensor> indices,
             std::optional<at::Tensor> inputs,
             std::optional<at::Tensor> targets SHMGRAD_GRADIENT_OPTIONS_FIELDS(
                 SHMGRAD_OPTION_PARAMETER)) {
            SHMGRAD_CHECK(inputs.has_value() == targets.has_value() &&
                              indices.has_value() != inputs.has_value(),
                          shmgrad::ErrorKind::kInvalidArgument,
                          "give either indices or both inputs and targets");
            shmgrad::GradientOptions options;
            SHMGRAD_GRADIENT_OPTIONS_FIELDS(SHMGRAD_OPTION_FROM_PARAMETER)
            shmgrad::GradientStats s;
            {
              py::gil_scoped_release nogil;
              s = indices ? t.gradient(*indices, options) : t.gradient(*inputs, *targets, options);
            }
            return s;
          },
          py::arg("indices"), py::arg("inputs"),
          py::arg("targets") SHMGRAD_GRADIENT_OPTIONS_FIELDS(SHMGRAD_GRADIENT_OPTION_ARG))
      // A structured batch (eager workers): its tensors and how they nest; then the options.
      .def(
          "gradient_structured",
          [](shmgrad::Trainer& t, const std::vector<at::Tensor>& leaves,
             const std::string& structure SHMGRAD_GRADIENT_OPTIONS_FIELDS(
                 SHMGRAD_OPTION_PARAMETER)) {
            shmgrad::GradientOptions options;
            SHMGRAD_GRADIENT_OPTIONS_FIELDS(SHMGRAD_OPTION_FROM_PARAMETER)
            py::gil_scoped_release nogil;
            return t.gradient(leaves, structure, options);
          },
          py::arg("leaves"),
          py::arg("structure") SHMGRAD_GRADIENT_OPTIONS_FIELDS(SHMGRAD_GRADIENT_OPTION_ARG));

  // The client side of a running engine (engine/control.h).
  m.def(
      "status",
      [](const std::string& name) { return statusToDict(shmgrad::engine::readStatus(name)); },
      py::arg("name"));
  m.def(
      "format_status",
      [](const std::string& name) {
        return shmgrad::engine::formatStatus(shmgrad::engine::readStatus(name));
      },
      py::arg("name"));
  m.def(
      "request_stop",
      [](const std::string& name, double timeout) {
        py::gil_scoped_release nogil;  // waits up to timeout for the engine to go
        return shmgrad::engine::requestStop(name, timeout);
      },
      py::arg("name"), py::arg("timeout") = shmgrad::engine::kDefaultStopTimeoutS);
  m.def("request_resize", &shmgrad::engine::requestResize, py::arg("name"), py::arg("workers"));
  m.def("loss_names", &lossNames);
  m.def("loss_functions", &lossFunctions);
  m.def(
      "shard_bounds",
      [](int64_t total, uint32_t parts, uint32_t rank) {
        int64_t begin = 0, end = 0;
        shmgrad::ipc::shardBounds(total, parts, rank, &begin, &end);
        return py::make_tuple(begin, end);
      },
      py::arg("total"), py::arg("parts"), py::arg("rank"));
  m.def("mean_scale", &shmgrad::ipc::meanScale, py::arg("count"));
  m.def(
      "accumulation_weights",
      [](bool mean, double prev_count, double count, double divisor) {
        const auto w = shmgrad::ipc::accumulationWeights(mean, prev_count, count, divisor);
        return py::make_tuple(w.prev, w.fresh);
      },
      py::arg("mean"), py::arg("prev_count"), py::arg("count"), py::arg("divisor"));
  // A model's description for the coordinator (engine/model_file.h): parameters are
  // float32, shared buffers float32 or int64; every tensor contiguous on the CPU.
  m.def(
      "write_model_file",
      [](const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& params,
         const std::vector<std::pair<std::string, torch::Tensor>>& buffers) {
        shmgrad::engine::ModelDescription d;
        for (const auto& [name, t] : params) {
          SHMGRAD_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu(),
                        shmgrad::ErrorKind::kInvalidArgument, "parameter ", name,
                        " must be a float32 CPU tensor");
          // Its elements as they lie in memory: a channels_last weight keeps its layout.
          const auto format = shmgrad::views::memoryFormatOf(t);
          const torch::Tensor v = shmgrad::views::inMemoryFormat(t, format);
          d.params.push_back({name, t.sizes().vec(), format});
          const float* p = v.data_ptr<float>();
          d.param_values.emplace_back(p, p + v.numel());
        }
        for (const auto& [name, t] : buffers) {
          const bool i64 = t.scalar_type() == torch::kInt64;
          SHMGRAD_CHECK((i64 || t.scalar_type() == torch::kFloat32) && t.device().is_cpu() &&
                            t.is_contiguous(),
                        shmgrad::ErrorKind::kInvalidArgument, "buffer ", name,
                        " must be a contiguous float32 or int64 CPU tensor");
          d.buffers.push_back({name, t.sizes().vec(),
                               i64 ? shmgrad::ipc::DType::kInt64 : shmgrad::ipc::DType::kFloat32});
          const auto* p = static_cast<const uint8_t*>(t.data_ptr());
          d.buffer_values.emplace_back(p, p + t.numel() * t.element_size());
        }
        shmgrad::engine::writeModelFile(path, d);
      },
      py::arg("path"), py::arg("params"), py::arg("buffers"));
  // ipc/config.h, for the Python API's defaults and its environment reads.
  {
    namespace config = shmgrad::config;
    py::dict d;
    d["max_batch"] = config::kDefaultMaxBatch;
    d["input_capacity_mb"] = config::kDefaultInputCapacityMb;
    d["startup_timeout"] = config::kDefaultStartupTimeoutS;
    d["threads_per_worker"] = config::kDefaultThreadsPerWorker;
    d["resize_timeout"] = config::kDefaultResizeTimeoutS;
    d["stop_timeout"] = config::kDefaultStopTimeoutS;
    m.attr("DEFAULTS") = d;
    // TUNABLES: (name, the default in words, meaning); TUNABLE_VALUES: name -> the value
    // that applies when unset, for those declared with one.
    py::list tunables;
    py::dict values;
    for (const config::Tunable& t : config::kTunables) {
      tunables.append(
          py::make_tuple(t.name, t.value != nullptr ? t.value : t.default_doc, t.meaning));
      if (t.value != nullptr) values[t.name] = t.value;
    }
    m.attr("TUNABLES") = tunables;
    m.attr("TUNABLE_VALUES") = values;
  }
  shmgrad::bindEagerWorker(m);
  // The `shmgrad` torch.distributed backend's creator (python/shmgrad/_backend.py
  // registers it): (store, rank, size, timeout) -> c10d Backend.
  m.def(
      "create_process_group_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
         const std::chrono::duration<float>& timeout, const std::string& key_prefix,
         const std::vector<int64_t>& node_of_rank, py::object leaders, py::object everyone) {
        using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
        auto backend = [](py::object o) {
          return o.is_none() ? BackendPtr() : o.cast<BackendPtr>();
        };
        return shmgrad::backend::ProcessGroupShm::create(store, rank, size, timeout, key_prefix,
                                                         node_of_rank, backend(leaders),
                                                         backend(everyone));
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("key_prefix"),
      py::arg("node_of_rank"), py::arg("leaders"), py::arg("everyone"));
  m.def(
      "process_group_arena_stats",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) {
        auto* shm = dynamic_cast<shmgrad::backend::ProcessGroupShm*>(backend.get());
        if (shm == nullptr) {
          throw py::value_error(
              "not a shmgrad backend: pass group._get_backend(cpu) of a "
              "group made with init_process_group(\"shmgrad\")");
        }
        return shm->arenaStats();
      },
      py::arg("backend"));
  m.def("segment_path", &shmgrad::ipc::segmentPath, py::arg("name"));
  m.def("segment_exists", &shmgrad::ipc::Segment::exists, py::arg("name"));
  m.def("check_engine_name", &shmgrad::ipc::checkEngineName, py::arg("name"));
}
