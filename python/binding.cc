// pybind11 module shmgrad._C: the C++ trainer API for Python. Tensors cross the
// boundary as torch.Tensor (the extension and Python's torch share one libtorch).
// The public, documented surface is the pure-Python package (python/shmgrad).
#include <torch/extension.h>

#include <optional>
#include <string>

#include "engine/control.h"
#include "engine/trainer.h"
#include "ipc/error.h"
#include "ipc/layout.h"
#include "ipc/segment.h"

namespace py = pybind11;

namespace {

// engine::EngineStatus as a dict: keys are the struct's field names, `workers` and
// `recent_steps` lists of dicts keyed by WorkerStatus's and StepSummary's field names.
py::dict statusToDict(const shmgrad::engine::EngineStatus& s) {
  py::list workers;
  for (const auto& w : s.workers) {
    py::dict wd;
    wd["slot"] = w.slot;
    wd["pid"] = w.pid;
    wd["state"] = w.state;
    wd["restarts"] = w.restarts;
    wd["busy_epoch"] = w.busy_epoch;
    wd["assigned_epoch"] = w.assigned_epoch;
    workers.append(wd);
  }
  py::list steps;
  for (const auto& r : s.recent_steps) {
    py::dict rd;
    rd["epoch"] = r.epoch;
    rd["workers"] = r.workers;
    rd["examples"] = r.examples;
    rd["loss_sum"] = r.loss_sum;
    rd["wall_seconds"] = r.wall_seconds;
    rd["compute_seconds"] = r.compute_seconds;
    rd["reduce_seconds"] = r.reduce_seconds;
    rd["wait_seconds"] = r.wait_seconds;
    steps.append(rd);
  }
  py::dict d;
  d["name"] = s.name;
  d["state"] = s.state;
  d["coordinator_pid"] = s.coordinator_pid;
  d["coordinator_alive"] = s.coordinator_alive;
  d["segment_path"] = s.segment_path;
  d["segment_bytes"] = s.segment_bytes;
  d["model_path"] = s.model_path;
  d["loss"] = s.loss;
  d["worker_kind"] = s.worker_kind;
  d["job_path"] = s.job_path;
  d["num_params"] = s.num_params;
  d["param_floats"] = s.param_floats;
  d["dataset"] = s.dataset;
  d["dataset_size"] = s.dataset_size;
  d["max_batch"] = s.max_batch;
  d["threads_per_worker"] = s.threads_per_worker;
  d["trainer_pid"] = s.trainer_pid;
  d["step_epoch"] = s.step_epoch;
  d["steps_served"] = s.steps_served;
  d["steps_aborted"] = s.steps_aborted;
  d["step_retries"] = s.step_retries;
  d["worker_restarts"] = s.worker_restarts;
  d["target_workers"] = s.target_workers;
  d["slots"] = s.slots;
  d["workers"] = workers;
  d["recent_steps"] = steps;
  return d;
}

// The loss names the engine accepts (ipc::kLossNames, whose index 0 is no loss).
py::list lossNames() {
  py::list names;
  for (const char* name : shmgrad::ipc::kLossNames) {
    if (name != nullptr) names.append(name);
  }
  return names;
}

shmgrad::GradientOptions makeOptions(bool mean, double timeout, int max_retries,
                                     int64_t min_examples_per_worker, int64_t max_examples_per_pass,
                                     bool raise_on_nonfinite, uint64_t seed, bool train) {
  shmgrad::GradientOptions o;
  o.seed = seed;
  o.train = train;
  o.mean = mean;
  o.timeout_seconds = timeout;
  o.max_retries = max_retries;
  o.min_examples_per_worker = min_examples_per_worker;
  o.max_examples_per_pass = max_examples_per_pass;
  o.raise_on_nonfinite = raise_on_nonfinite;
  return o;
}

}  // namespace

namespace shmgrad {
void bindEagerWorker(py::module_& m);  // python/worker_binding.cc
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "shmgrad native module (use the shmgrad package instead)";

  // What this module was compiled against (shmgrad.build_info() adds the Python side).
  m.def("build_info", [] {
    py::dict d;
    d["torch"] = TORCH_VERSION;
    d["cxx11_abi"] = static_cast<bool>(_GLIBCXX_USE_CXX11_ABI);
    d["cuda"] = false;  // the CUDA path is not built yet
    d["cuda_toolkit"] = py::none();
    d["compiler"] = __VERSION__;
    return d;
  });

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
      exc.attr("error_type") = e.errorType().empty() ? py::none() : py::object(py::str(e.errorType()));
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });

  // One gradient call's statistics, moved out of the call as they are: nothing is
  // converted until Python reads a field (shmgrad.GradientStats is the public view).
  using Stats = shmgrad::GradientStats;
  py::class_<Stats>(m, "NativeStats")
      .def_readonly("num_examples", &Stats::num_examples)
      .def_readonly("loss_sum", &Stats::loss_sum)
      .def_readonly("loss", &Stats::loss)
      .def_readonly("wall_seconds", &Stats::wall_seconds)
      .def_readonly("reduce_seconds", &Stats::reduce_seconds)
      .def_readonly("retries", &Stats::retries)
      .def_readonly("nonfinite", &Stats::nonfinite)
      .def_readonly("prepare_seconds", &Stats::prepare_seconds)
      .def_readonly("step_seconds", &Stats::step_seconds)
      .def_readonly("wake_seconds", &Stats::wake_seconds)
      .def_readonly("finish_seconds", &Stats::finish_seconds)
      // (slot, examples, loss_sum, compute_s, reduce_s, wait_s, nonfinite_loss,
      //  nonfinite_grad) per participant, in rank order.
      .def_property_readonly("workers", [](const Stats& s) {
        py::list out;
        for (const auto& w : s.workers) {
          out.append(py::make_tuple(w.slot, w.examples, w.loss_sum, w.compute_seconds,
                                    w.reduce_seconds, w.wait_seconds, w.nonfinite_loss,
                                    w.nonfinite_grad));
        }
        return out;
      });

  py::class_<shmgrad::Trainer>(m, "Trainer")
      .def_static(
          "attach",
          [](const std::string& name, double timeout, bool lease) {
            shmgrad::AttachOptions o;
            o.timeout_seconds = timeout;
            o.lease = lease;
            py::gil_scoped_release nogil;
            return shmgrad::Trainer::attach(name, o);
          },
          py::arg("name"), py::arg("timeout") = 30.0, py::arg("lease") = true)
      .def("parameters",
           [](const shmgrad::Trainer& t) {
             py::list out;
             for (const auto& p : t.parameters()) out.append(py::make_tuple(p.name, p.shape));
             return out;
           })
      .def("parameter_views", &shmgrad::Trainer::parameterViews)
      .def("gradient_views", &shmgrad::Trainer::gradientViews)
      .def("parameter_buffer", &shmgrad::Trainer::parameterBuffer)
      .def("buffer_views", &shmgrad::Trainer::bufferViews)
      .def("gradient_buffer", &shmgrad::Trainer::gradientBuffer)
      .def("dataset_size", &shmgrad::Trainer::datasetSize)
      .def("worker_count", &shmgrad::Trainer::workerCount)
      .def("slot_count", &shmgrad::Trainer::slotCount)
      .def("coordinator_pid", &shmgrad::Trainer::coordinatorPid)
      .def("closed", &shmgrad::Trainer::closed)
      .def("close", &shmgrad::Trainer::close)
      .def(
          "gradient",
          // One batch: `indices` into the engine's dataset, or `inputs` and `targets`.
          [](shmgrad::Trainer& t, std::optional<at::Tensor> indices,
             std::optional<at::Tensor> inputs, std::optional<at::Tensor> targets, bool mean,
             double timeout, int max_retries, int64_t min_epw, int64_t max_epp,
             bool raise_nonfinite, uint64_t seed, bool train) {
            SHMGRAD_CHECK(inputs.has_value() == targets.has_value() &&
                              indices.has_value() != inputs.has_value(),
                          shmgrad::ErrorKind::kInvalidArgument,
                          "give either indices or both inputs and targets");
            auto o = makeOptions(mean, timeout, max_retries, min_epw, max_epp, raise_nonfinite,
                                 seed, train);
            shmgrad::GradientStats s;
            {
              py::gil_scoped_release nogil;
              s = indices ? t.gradient(*indices, o) : t.gradient(*inputs, *targets, o);
            }
            return s;
          },
          py::arg("indices"), py::arg("inputs"), py::arg("targets"), py::arg("mean"),
          py::arg("timeout"), py::arg("max_retries"), py::arg("min_examples_per_worker"),
          py::arg("max_examples_per_pass"), py::arg("raise_on_nonfinite"), py::arg("seed") = 0,
          py::arg("train") = true);

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
  shmgrad::bindEagerWorker(m);
  m.def("segment_path", &shmgrad::ipc::segmentPath, py::arg("name"));
  m.def("segment_exists", &shmgrad::ipc::Segment::exists, py::arg("name"));
  m.def("check_engine_name", &shmgrad::ipc::checkEngineName, py::arg("name"));
}
