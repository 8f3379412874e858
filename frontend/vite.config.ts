// Vite build of the dashboard: `npm run build` writes dist/, which the backend serves at `/` (backend/main.py).
// `npm run dev` serves it on :5173 and proxies /api and /healthz to a backend on :8000 (`tlt up`).
import { defineConfig } from "vite";

export default defineConfig({
  base: "./",
  build: { outDir: "dist", emptyOutDir: true, chunkSizeWarningLimit: 400 },
  server: { proxy: { "/api": "http://127.0.0.1:8000", "/healthz": "http://127.0.0.1:8000" } },
});
