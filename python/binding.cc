// pybind11 module shmgrad._C: the C++ trainer API for Python. Tensors cross the
// boundary as torch.Tensor (the extension and Python's torch share one libtorch).
// The public, documented surface is the pure-Python package (python/shmgrad).
#include <torch/extension.h>

#include <optional>
#include <string>

#include "engine/coordinator.h"
#include "engine/trainer.h"
#include "ipc/error.h"
#include "ipc/segment.h"

namespace py = pybind11;

namespace {

py::dict statsToDict(const shmgrad::GradientStats& s) {
  py::dict d;
  d["num_examples"] = s.num_examples;
  d["loss_sum"] = s.loss_sum;
  d["loss"] = s.loss;
  d["wall_seconds"] = s.wall_seconds;
  d["reduce_seconds"] = s.reduce_seconds;
  d["retries"] = s.retries;
  d["nonfinite"] = s.nonfinite;
  py::list workers;
  for (const auto& w : s.workers) {
    py::dict wd;
    wd["slot"] = w.slot;
    wd["examples"] = w.examples;
    wd["loss_sum"] = w.loss_sum;
    wd["compute_seconds"] = w.compute_seconds;
    wd["reduce_seconds"] = w.reduce_seconds;
    wd["wait_seconds"] = w.wait_seconds;
    wd["nonfinite_loss"] = w.nonfinite_loss;
    wd["nonfinite_grad"] = w.nonfinite_grad;
    workers.append(wd);
  }
  d["workers"] = workers;
  return d;
}

shmgrad::GradientOptions makeOptions(bool mean, double timeout, int max_retries,
                                     int64_t min_examples_per_worker, int64_t max_examples_per_pass,
                                     bool raise_on_nonfinite) {
  shmgrad::GradientOptions o;
  o.mean = mean;
  o.timeout_seconds = timeout;
  o.max_retries = max_retries;
  o.min_examples_per_worker = min_examples_per_worker;
  o.max_examples_per_pass = max_examples_per_pass;
  o.raise_on_nonfinite = raise_on_nonfinite;
  return o;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "shmgrad native module (use the shmgrad package instead)";

  // shmgrad::Error -> shmgrad.errors.<class for its kind>, resolved at raise time.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const shmgrad::Error& e) {
      py::gil_scoped_acquire gil;
      py::object errors = py::module_::import("shmgrad.errors");
      py::object cls = errors.attr("error_class")(shmgrad::errorKindName(e.kind()));
      PyErr_SetObject(cls.ptr(), py::str(e.what()).ptr());
    }
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
             bool raise_nonfinite) {
            SHMGRAD_CHECK(inputs.has_value() == targets.has_value() &&
                              indices.has_value() != inputs.has_value(),
                          shmgrad::ErrorKind::kInvalidArgument,
                          "give either indices or both inputs and targets");
            auto o = makeOptions(mean, timeout, max_retries, min_epw, max_epp, raise_nonfinite);
            shmgrad::GradientStats s;
            {
              py::gil_scoped_release nogil;
              s = indices ? t.gradient(*indices, o) : t.gradient(*inputs, *targets, o);
            }
            return statsToDict(s);
          },
          py::arg("indices"), py::arg("inputs"), py::arg("targets"), py::arg("mean"),
          py::arg("timeout"), py::arg("max_retries"), py::arg("min_examples_per_worker"),
          py::arg("max_examples_per_pass"), py::arg("raise_on_nonfinite"));

  m.def("status_text", &shmgrad::engine::statusText, py::arg("name"));
  m.def(
      "request_stop",
      [](const std::string& name, double timeout) {
        py::gil_scoped_release nogil;
        return shmgrad::engine::requestStop(name, timeout);
      },
      py::arg("name"), py::arg("timeout") = 30.0);
  m.def("request_resize", &shmgrad::engine::requestResize, py::arg("name"), py::arg("workers"));
  m.def("segment_path", &shmgrad::ipc::segmentPath, py::arg("name"));
  m.def("segment_exists", &shmgrad::ipc::Segment::exists, py::arg("name"));
  m.def("check_engine_name", &shmgrad::ipc::checkEngineName, py::arg("name"));
}
